"""A rollback to the version this process saved is copied from the staging buffers that
still hold its chunks, each verified against its checksum; otherwise it reads the disk."""

from __future__ import annotations

from pcframe import Checkpointer
from pcframe.restore import reader
from pcframe.store.directory import CheckpointDir
from tests.helpers import adamw_mlp, adamw_step, live_values, same_values

SMALL = {"chunk_bytes": 64 << 10, "read_threads": 2}


def _count_disk_reads(monkeypatch) -> list[int]:
    """Chunks of data.bin read from disk (verifying reads and fills), counted."""
    reads: list[int] = []
    verify, fill = reader._VersionReader._read_chunk, reader.preadv_all

    def counted_verify(self, chunk, flats):
        reads.append(chunk.index)
        return verify(self, chunk, flats)

    def counted_fill(*args, **kwargs):
        reads.append(-1)
        return fill(*args, **kwargs)

    monkeypatch.setattr(reader._VersionReader, "_read_chunk", counted_verify)
    monkeypatch.setattr(reader, "preadv_all", counted_fill)
    return reads


def test_a_rollback_is_copied_from_the_staging_buffers_without_reading_the_disk(
    tmp_path, monkeypatch
):
    model, optimizer = adamw_mlp()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
        saved = live_values(model, optimizer)
        pointers = [t.data_ptr() for t in model.state_dict().values()]
        for _ in range(2):
            adamw_step(model, optimizer)
            reads = _count_disk_reads(monkeypatch)
            assert ckpt.restore() == 1
            monkeypatch.undo()
            assert reads == []  # every chunk came from memory, twice in a row
            assert same_values(live_values(model, optimizer), saved)
        assert [t.data_ptr() for t in model.state_dict().values()] == pointers
        # Training goes on: the next version overwrites the buffers and is itself held.
        adamw_step(model, optimizer)
        stepped = live_values(model, optimizer)
        ckpt.save(2).wait()
        adamw_step(model, optimizer)
        reads = _count_disk_reads(monkeypatch)
        assert ckpt.restore() == 2
        monkeypatch.undo()
        assert reads == [] and same_values(live_values(model, optimizer), stepped)
        # An older version is no longer held: read from disk, exactly.
        assert ckpt.restore(version=1) == 1
        assert same_values(live_values(model, optimizer), saved)


def test_a_staged_chunk_changed_in_memory_is_read_from_disk_instead(tmp_path, monkeypatch):
    """A bit flipped in a staging buffer (stray write, bad RAM) fails the chunk's checksum:
    the whole version is read from disk, restores exactly and nothing is set aside."""
    model, optimizer = adamw_mlp()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
        saved = live_values(model, optimizer)
        pool = ckpt._pipeline.pool
        with pool.lend() as buffers:
            held = pool.holding(buffers)[1]
            chunk = sorted(held)[len(held) // 2]
            held[chunk][100] ^= 0xFF
        adamw_step(model, optimizer)
        reads = _count_disk_reads(monkeypatch)
        assert ckpt.restore() == 1
        monkeypatch.undo()
        assert chunk in reads
        assert same_values(live_values(model, optimizer), saved)
        assert ckpt.last_restore.skipped == []
    assert CheckpointDir(tmp_path).committed_versions() == [1]


def test_a_pool_smaller_than_the_version_reads_the_disk(tmp_path, monkeypatch):
    model, optimizer = adamw_mlp()
    options = {**SMALL, "staging_ratio": 0.5}
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **options) as ckpt:
        ckpt.save(1).wait()
        saved = live_values(model, optimizer)
        adamw_step(model, optimizer)
        reads = _count_disk_reads(monkeypatch)
        assert ckpt.restore() == 1
        monkeypatch.undo()
        assert reads
        assert same_values(live_values(model, optimizer), saved)


def test_buffers_a_restore_wrote_over_hold_nothing_afterwards(tmp_path, monkeypatch):
    """A restore from disk keeps the live bytes in the lent buffers (spare memory): they no
    longer hold the chunks, and the next rollback reads the disk and is exact."""
    model, optimizer = adamw_mlp()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
        first = live_values(model, optimizer)
        adamw_step(model, optimizer)
        ckpt.save(2).wait()
        second = live_values(model, optimizer)
        adamw_step(model, optimizer)
        assert ckpt.restore(version=1) == 1  # from disk, the buffers as spare memory
        assert same_values(live_values(model, optimizer), first)
        assert ckpt.last_restore.direct_bytes > 0
        pool = ckpt._pipeline.pool
        with pool.lend() as buffers:
            assert pool.holding(buffers) == {}
        reads = _count_disk_reads(monkeypatch)
        assert ckpt.restore() == 2
        monkeypatch.undo()
        assert reads
        assert same_values(live_values(model, optimizer), second)
