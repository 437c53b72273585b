"""A checkpointer that has saved restores straight into the live tensors, once, and keeps
their old bytes in its idle staging pool: every failure puts them back.

The restore of a fresh checkpointer (no pool yet) verifies first and reads twice; that path
is ``test_restore_in_place.py``'s. A pool that still holds the version's chunks serves the
rollback from memory instead (``test_restore_staged.py``): here every chunk is read from
disk, as when the pool no longer holds them.
"""

from __future__ import annotations

import contextlib
import errno

import pytest
import torch

from pcframe import Checkpointer
from pcframe.errors import CheckpointError, NoValidCheckpoint
from pcframe.restore import reader
from pcframe.restore.live import Spare
from pcframe.restore.reader import load_version
from pcframe.save.staging import StagingPool
from pcframe.state import apply
from pcframe.state.in_place import in_place_targets
from tests.helpers import (
    adamw_mlp,
    adamw_step,
    disk_reads_only,
    live_values,
    same_values,
)

SMALL = {"chunk_bytes": 64 << 10, "read_threads": 1}  # many chunks, read in file order


@pytest.fixture(autouse=True)
def _from_disk(monkeypatch):
    disk_reads_only(monkeypatch)


def _corrupt_chunk(directory, version: int, at: float) -> None:
    data = directory / f"v{version:08d}" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[int(len(raw) * at)] ^= 0xFF
    data.write_bytes(bytes(raw))


def _no_second_read(monkeypatch) -> None:
    def second_read(self, chunk, flats):
        raise AssertionError("read a second time")

    monkeypatch.setattr(reader._VersionReader, "_read_pieces", second_read)


@contextlib.contextmanager
def _saved_then_stepped(tmp_path, **options):
    """A checkpointer that saved version 1 (its pool now idle), the objects a step past it,
    and their values before any restore: ``(ckpt, model, optimizer, before)``."""
    model, optimizer = adamw_mlp()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **{**SMALL, **options}) as ckpt:
        ckpt.save(1).wait()
        adamw_step(model, optimizer)
        yield ckpt, model, optimizer, live_values(model, optimizer)


def test_a_rollback_reads_each_byte_once_and_leaves_the_pool_to_the_next_save(
    tmp_path, monkeypatch
):
    model, optimizer = adamw_mlp()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
        saved = live_values(model, optimizer)
        pointers = {k: v.data_ptr() for k, v in model.state_dict().items()}
        adamw_step(model, optimizer)
        _no_second_read(monkeypatch)
        assert ckpt.restore() == 1
        report = ckpt.last_restore
        assert same_values(live_values(model, optimizer), saved)
        assert {k: v.data_ptr() for k, v in model.state_dict().items()} == pointers
        assert report.direct_bytes == report.in_place_bytes > 0
        # The pool came back whole: the next version is the restored state, byte for byte.
        adamw_step(model, optimizer)
        stepped = live_values(model, optimizer)
        ckpt.save(2).wait()
    monkeypatch.undo()
    named = load_version(tmp_path / "v00000002").named_tensors()
    model_entries = {k: v for k, v in named.items() if k.startswith("model/")}
    assert model_entries.keys() == {k for k in stepped if k.startswith("model/")}
    assert all(torch.equal(v, stepped[k]) for k, v in model_entries.items())


@pytest.mark.parametrize("at", [0.1, 0.5, 0.95])
def test_a_damaged_version_puts_back_every_byte_read_over(tmp_path, at):
    model, optimizer = adamw_mlp()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
        _corrupt_chunk(tmp_path, 1, at)
        adamw_step(model, optimizer)
        before = live_values(model, optimizer)
        with pytest.raises(NoValidCheckpoint):
            ckpt.restore()
        assert same_values(live_values(model, optimizer), before)


def test_a_damaged_newest_version_falls_back_to_an_exact_older_one(tmp_path):
    model, optimizer = adamw_mlp()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
        first = live_values(model, optimizer)
        adamw_step(model, optimizer)
        ckpt.save(2).wait()
        _corrupt_chunk(tmp_path, 2, 0.9)
        adamw_step(model, optimizer)
        assert ckpt.restore() == 1
        assert ckpt.last_restore.direct_bytes > 0
        assert same_values(live_values(model, optimizer), first)


def test_an_io_error_mid_read_puts_the_bytes_back(tmp_path, monkeypatch):
    with _saved_then_stepped(tmp_path) as (ckpt, model, optimizer, before):
        real = reader._VersionReader._read_chunk
        calls = []

        def failing(self, chunk, flats):
            calls.append(chunk.index)
            if len(calls) == 6:  # every attempt fails at its sixth chunk
                calls.clear()
                raise OSError(errno.EIO, "Input/output error", str(self.data_path))
            real(self, chunk, flats)

        monkeypatch.setattr(reader._VersionReader, "_read_chunk", failing)
        monkeypatch.setattr("pcframe.restore.sources.BACKOFF", 0.0)
        with pytest.raises(CheckpointError, match="cannot read checkpoint version 1"):
            ckpt.restore()
        assert same_values(live_values(model, optimizer), before)


class Refusing:
    """A stateful object that refuses any state but its own: its load fails after the
    version was read, and the rollback (its own state) succeeds."""

    def __init__(self) -> None:
        self.n = 1

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise RuntimeError("refused")


def test_a_load_failing_after_the_read_puts_the_bytes_back(tmp_path):
    model, optimizer = adamw_mlp()
    stateful = {"loader": Refusing()}
    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, stateful=stateful, **SMALL
    ) as ckpt:
        ckpt.save(1).wait()
        stateful["loader"].n = 2
        adamw_step(model, optimizer)
        before = live_values(model, optimizer)
        with pytest.raises(CheckpointError, match="rolled back"):
            ckpt.restore()
        assert ckpt.last_restore.direct_bytes == 0  # nothing was reported loaded
        assert same_values(live_values(model, optimizer), before)


def test_a_mismatching_version_read_straight_in_changes_nothing(tmp_path):
    model, optimizer = adamw_mlp()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
    other = torch.optim.Adam(model.parameters())  # AdamW was saved: refused after the read
    adamw_step(model, other)
    # take_over: it saves (to have a pool) beside the version it then fails to restore
    with Checkpointer(tmp_path, model=model, optimizer=other, take_over=True, **SMALL) as ckpt:
        ckpt.save(2).wait()  # this checkpointer's pool exists
        adamw_step(model, other)
        before = live_values(model, other)
        with pytest.raises(CheckpointError):
            ckpt.restore(version=1)
        assert same_values(live_values(model, other), before)


def test_a_pool_smaller_than_the_state_reads_the_rest_twice(tmp_path):
    model, optimizer = adamw_mlp()
    options = {**SMALL, "staging_ratio": 0.3}
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **options) as ckpt:
        ckpt.save(1).wait()
        saved = live_values(model, optimizer)
        adamw_step(model, optimizer)
        ckpt.restore()
        report = ckpt.last_restore
        assert 0 < report.direct_bytes < report.in_place_bytes
        assert same_values(live_values(model, optimizer), saved)
        _corrupt_chunk(tmp_path, 1, 0.95)  # past the chunks the pool had room for
        adamw_step(model, optimizer)
        before = live_values(model, optimizer)
        with pytest.raises(NoValidCheckpoint):
            ckpt.restore()
        assert same_values(live_values(model, optimizer), before)


def _read_with_spare(tmp_path, model, optimizer):
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
    saved = live_values(model, optimizer)
    adamw_step(model, optimizer)
    before = live_values(model, optimizer)
    spare = Spare([torch.empty(1 << 20, dtype=torch.uint8) for _ in range(4)])
    loaded = load_version(
        tmp_path / "v00000001", threads=2, targets=in_place_targets(model, optimizer), spare=spare
    )
    return loaded, saved, before


def test_only_the_sections_that_loaded_keep_the_new_bytes(tmp_path):
    model, optimizer = adamw_mlp()
    loaded, saved, before = _read_with_spare(tmp_path, model, optimizer)
    assert loaded.in_place.direct_bytes == loaded.in_place_bytes
    assert loaded.fill({"optimizer"}) > 0  # the model's load failed (strict=False)
    loaded.release()
    now = live_values(model, optimizer)
    assert all(torch.equal(now[k], before[k]) for k in now if k.startswith("model/"))
    moments = [k for k in now if k.startswith("opt/") and not k.endswith("/step")]
    assert moments and all(torch.equal(now[k], saved[k]) for k in moments)


def test_a_rollback_after_the_fill_puts_everything_back(tmp_path):
    model, optimizer = adamw_mlp()
    loaded, _, before = _read_with_spare(tmp_path, model, optimizer)
    loaded.fill({"model", "optimizer"})
    assert loaded.in_place.unfill()  # nothing was read a second time: all can go back
    loaded.release()
    assert same_values(live_values(model, optimizer), before)


def test_a_version_let_go_before_its_fill_leaves_the_live_tensors_as_they_were(tmp_path):
    model, optimizer = adamw_mlp()
    loaded, _, before = _read_with_spare(tmp_path, model, optimizer)
    loaded.release()
    assert same_values(live_values(model, optimizer), before)


def test_the_pool_lends_every_buffer_only_while_none_is_out():
    pool = StagingPool(4096)
    with pool.lend() as spare:
        assert spare == []  # not allocated yet
    pool.ensure(4 * 4096, pinned=False)
    with pool.lend() as spare:
        assert len(spare) == 4
        assert pool.try_acquire() is None  # a save meanwhile would wait, not share
    buffer = pool.acquire()
    with pool.lend() as spare:
        assert spare == []  # a save holds a buffer: nothing is idle
    pool.release(buffer)
    with pool.lend() as spare:
        assert len(spare) == 4
    pool.close()
    with pool.lend() as spare:
        assert spare == []


class Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight (saved under both names)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 128)
        self.body = torch.nn.Linear(128, 128)
        self.head = torch.nn.Linear(128, 512, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


@pytest.mark.parametrize("read_threads", [1, 4])
def test_tied_weights_are_put_back_exactly(tmp_path, read_threads):
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = {**SMALL, "read_threads": read_threads}

    def step() -> None:
        model(torch.randint(0, 512, (8,))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **options) as ckpt:
        ckpt.save(1).wait()
        saved = live_values(model, optimizer)
        step()
        ckpt.restore()
        assert ckpt.last_restore.direct_bytes > 0  # the untied tensors are read once
        assert same_values(live_values(model, optimizer), saved)
        assert model.head.weight is model.embed.weight
        _corrupt_chunk(tmp_path, 1, 0.97)
        step()
        before = live_values(model, optimizer)
        with pytest.raises(NoValidCheckpoint):
            ckpt.restore()
        assert same_values(live_values(model, optimizer), before)


class InterruptedWhileJoined:
    """The optimizer's scratch step, joined after the read: Ctrl-C lands in the join."""

    def join(self) -> None:
        raise KeyboardInterrupt


def test_an_interrupt_between_the_read_and_the_apply_puts_the_bytes_back(tmp_path, monkeypatch):
    with _saved_then_stepped(tmp_path) as (ckpt, model, optimizer, before):
        monkeypatch.setattr(
            "pcframe.restore.restorer.prefetch_fresh_state", lambda _: InterruptedWhileJoined()
        )
        with pytest.raises(KeyboardInterrupt):
            ckpt.restore()
        assert same_values(live_values(model, optimizer), before)


def test_interrupts_while_reading_wait_for_the_reads_in_progress(tmp_path, monkeypatch):
    """Ctrl-C, then more while the reader waits for its threads: a read still landing in
    live memory after the put-back would leave new bytes there."""
    import time

    from pcframe.restore import chunk_io as reading

    with _saved_then_stepped(tmp_path, read_threads=4) as (ckpt, model, optimizer, before):
        real = reading.preadv_all

        def slow(fd, buffers, offset, path):  # the bytes land well after the call began
            scratch = [memoryview(bytearray(len(b))) for b in buffers]
            real(fd, scratch, offset, path)
            time.sleep(0.1)
            for buffer, read in zip(buffers, scratch, strict=True):
                buffer[:] = read

        def interrupted(*_args, **_kwargs):
            time.sleep(0.03)  # the threads have kept their chunks and are reading
            raise KeyboardInterrupt

        monkeypatch.setattr(reading, "preadv_all", slow)
        monkeypatch.setattr(reader, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            ckpt.restore()
        assert same_values(live_values(model, optimizer), before)


class Aliased(torch.nn.Module):
    """A buffer that is a transposed view of a parameter: the model's load writes and its
    undo copies that memory on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(256, 256)
        self.register_buffer("weight_t", self.lin.weight.detach().t())


def test_memory_another_tensor_sees_is_not_read_over(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = Aliased()
    with Checkpointer(tmp_path, model=model, **SMALL) as ckpt:
        ckpt.save(1).wait()
        saved = model.lin.weight.detach().clone()
        with torch.no_grad():
            model.lin.weight.add_(1.0)
        before = model.lin.weight.detach().clone()
        real, calls = apply.restore_rng, []

        def fails_once(state, skip=frozenset()):  # the step after the fill fails
            calls.append(state)
            if len(calls) == 1:
                raise RuntimeError("refused")
            return real(state, skip)

        monkeypatch.setattr(apply, "restore_rng", fails_once)
        with pytest.raises(CheckpointError):
            ckpt.restore()
        assert torch.equal(model.lin.weight.detach(), before)
        monkeypatch.undo()
        ckpt.restore()
        report = ckpt.last_restore
        weight_bytes = saved.numel() * saved.element_size()
        assert report.direct_bytes == report.in_place_bytes - weight_bytes
        assert torch.equal(model.lin.weight.detach(), saved)


def test_the_report_counts_only_the_sections_that_loaded(tmp_path):
    model, optimizer = adamw_mlp()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
    other = torch.optim.Adam(model.parameters())  # AdamW was saved: the optimizer is left out
    adamw_step(model, other)
    with Checkpointer(tmp_path, model=model, optimizer=other, take_over=True, **SMALL) as ckpt:
        ckpt.save(2).wait()
        ckpt.restore(version=1, strict=False)
        report = ckpt.last_restore
    model_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert report.not_loaded
    assert report.direct_bytes == report.in_place_bytes == model_bytes
