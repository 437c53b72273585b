"""A rollback to the version this process saved is copied from the staging buffers that
still hold its chunks, each verified against its checksum; otherwise it reads the disk."""

from __future__ import annotations

import torch

from pcframe import Checkpointer
from pcframe.restore import reader
from pcframe.store.directory import CheckpointDir

SMALL = {"chunk_bytes": 64 << 10, "read_threads": 2}


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 256)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _state(model, optimizer) -> list[torch.Tensor]:
    moments = [v for s in optimizer.state.values() for v in s.values()]
    return [t.clone() for t in [*model.state_dict().values(), *moments]]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


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
    model, optimizer = _objects()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
        saved = _state(model, optimizer)
        pointers = [t.data_ptr() for t in model.state_dict().values()]
        for _ in range(2):
            _step(model, optimizer)
            reads = _count_disk_reads(monkeypatch)
            assert ckpt.restore() == 1
            monkeypatch.undo()
            assert reads == []  # every chunk came from memory, twice in a row
            assert _same(_state(model, optimizer), saved)
        assert [t.data_ptr() for t in model.state_dict().values()] == pointers
        # Training goes on: the next version overwrites the buffers and is itself held.
        _step(model, optimizer)
        stepped = _state(model, optimizer)
        ckpt.save(2).wait()
        _step(model, optimizer)
        reads = _count_disk_reads(monkeypatch)
        assert ckpt.restore() == 2
        monkeypatch.undo()
        assert reads == [] and _same(_state(model, optimizer), stepped)
        # An older version is no longer held: read from disk, exactly.
        assert ckpt.restore(version=1) == 1
        assert _same(_state(model, optimizer), saved)


def test_a_staged_chunk_changed_in_memory_is_read_from_disk_instead(tmp_path, monkeypatch):
    """A bit flipped in a staging buffer (stray write, bad RAM) fails the chunk's checksum:
    the whole version is read from disk, restores exactly and nothing is set aside."""
    model, optimizer = _objects()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
        saved = _state(model, optimizer)
        pool = ckpt.pipeline.pool
        with pool.lend() as buffers:
            held = pool.holding(buffers)[1]
            chunk = sorted(held)[len(held) // 2]
            held[chunk][100] ^= 0xFF
        _step(model, optimizer)
        reads = _count_disk_reads(monkeypatch)
        assert ckpt.restore() == 1
        monkeypatch.undo()
        assert chunk in reads
        assert _same(_state(model, optimizer), saved)
        assert ckpt.last_restore.skipped == []
    assert CheckpointDir(tmp_path).committed_versions() == [1]


def test_a_pool_smaller_than_the_version_reads_the_disk(tmp_path, monkeypatch):
    model, optimizer = _objects()
    options = {**SMALL, "staging_ratio": 0.5}
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **options) as ckpt:
        ckpt.save(1).wait()
        saved = _state(model, optimizer)
        _step(model, optimizer)
        reads = _count_disk_reads(monkeypatch)
        assert ckpt.restore() == 1
        monkeypatch.undo()
        assert reads
        assert _same(_state(model, optimizer), saved)


def test_buffers_a_restore_wrote_over_hold_nothing_afterwards(tmp_path, monkeypatch):
    """A restore from disk keeps the live bytes in the lent buffers (spare memory): they no
    longer hold the chunks, and the next rollback reads the disk and is exact."""
    model, optimizer = _objects()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
        first = _state(model, optimizer)
        _step(model, optimizer)
        ckpt.save(2).wait()
        second = _state(model, optimizer)
        _step(model, optimizer)
        assert ckpt.restore(version=1) == 1  # from disk, the buffers as spare memory
        assert _same(_state(model, optimizer), first)
        assert ckpt.last_restore.direct_bytes > 0
        pool = ckpt.pipeline.pool
        with pool.lend() as buffers:
            assert pool.holding(buffers) == {}
        reads = _count_disk_reads(monkeypatch)
        assert ckpt.restore() == 2
        monkeypatch.undo()
        assert reads
        assert _same(_state(model, optimizer), second)
