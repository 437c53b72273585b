"""The queue of device-to-host chunk copies (pcframe.save.copy.DeviceCopies).

CPU twin of the queued CUDA copies: a CUDA event cannot exist without a GPU, so these runs
use an event that completes when the test says so; the real events run in the gpu-marked
round trips (tests/checkpointer/test_roundtrip.py, test_copy_backends.py).
"""

from __future__ import annotations

import pytest

from pcframe.save.copy import DEVICE_COPIES_AHEAD, DeviceCopies
from pcframe.save.staging import StagingPool

CHUNK = 4096


class Copy:
    """Stands in for a CUDA event: ``query`` is False until the device 'finishes'."""

    def __init__(self, log: list, name: int) -> None:
        self.log, self.name, self.done = log, name, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(("waited", self.name))
        self.done = True


class Failed(Copy):
    """A copy the device failed: a CUDA error is sticky, every wait raises it again."""

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _pool(buffers: int) -> StagingPool:
    pool = StagingPool(CHUNK)
    pool.ensure(buffers * CHUNK, pinned=False)
    return pool


def test_copies_are_queued_ahead_and_handed_off_in_order_once_complete():
    pool, log, handed = _pool(16), [], []
    copies = DeviceCopies(pool, lambda unit, buffer: handed.append(unit))
    events = []
    for unit in range(10):
        buffer = copies.buffer()
        events.append(Copy(log, unit))
        copies.queued(unit, buffer, events[-1])
        # never more than DEVICE_COPIES_AHEAD queued beyond the one being waited for
        assert unit + 1 - len(handed) <= DEVICE_COPIES_AHEAD
    assert handed == list(range(10 - DEVICE_COPIES_AHEAD))
    events[10 - DEVICE_COPIES_AHEAD].done = True  # the device finished the oldest queued
    copies.queued("late", copies.buffer(), Copy(log, "late"))
    assert handed[10 - DEVICE_COPIES_AHEAD] == 10 - DEVICE_COPIES_AHEAD
    copies.drain()
    assert handed == [*range(10), "late"]
    # a chunk is handed off only after its copy was waited for (or seen complete)
    waited = [name for what, name in log if what == "waited"]
    assert waited == sorted(waited, key=lambda n: 99 if n == "late" else n)


def test_an_empty_pool_hands_queued_chunks_off_instead_of_waiting_for_a_buffer():
    """With every buffer queued, waiting for the pool would wait forever (the writers free
    buffers only once they have the chunks): the oldest goes to a writer first."""
    pool, log = _pool(2), []
    handed = []

    def writer(unit, buffer):  # a writer that persists at once and frees its buffer
        handed.append(unit)
        pool.release(buffer)

    copies = DeviceCopies(pool, writer)
    for unit in range(6):
        copies.queued(unit, copies.buffer(), Copy(log, unit))
    copies.drain()
    assert handed == list(range(6))


def test_abandon_returns_queued_buffers_after_the_device_is_done_with_them():
    pool, log, handed = _pool(3), [], []
    copies = DeviceCopies(pool, lambda unit, buffer: handed.append(unit))
    for unit in range(2):
        copies.queued(unit, copies.buffer(), Copy(log, unit))
    copies.abandon()
    assert handed == [] and log == [("waited", 0), ("waited", 1)]
    assert len([pool.try_acquire() for _ in range(3)]) == 3  # all three are free again
    assert pool.try_acquire() is None


def test_a_failed_wait_returns_the_buffer_and_raises():
    pool, log = _pool(1), []
    copies = DeviceCopies(pool, lambda unit, buffer: None)
    copies.queued(0, copies.buffer(), Failed(log, 0))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        copies.drain()
    assert pool.try_acquire() is not None


@pytest.mark.parametrize("chunk_bytes", [1 << 24, 1 << 20, 3 << 20, 1 << 31])
@pytest.mark.parametrize("count", [1, 7, 64, 65, 768, 1000])
def test_a_pinned_pool_is_allocated_in_blocks_the_allocator_does_not_round_up(count, chunk_bytes):
    """torch's pinned allocator rounds each allocation up to a power of two (a 12 GiB pool
    held 16 GiB on an H200): blocks of whole chunks, at most 1 GiB (or one chunk), and with
    a power-of-two chunk every block is a power of two in bytes."""
    from pcframe.save.staging import PINNED_BLOCK_BYTES, pinned_blocks

    blocks = pinned_blocks(count, chunk_bytes)
    assert sum(blocks) == count and all(b >= 1 for b in blocks)
    assert all(b * chunk_bytes <= max(PINNED_BLOCK_BYTES, chunk_bytes) for b in blocks)
    if chunk_bytes & (chunk_bytes - 1) == 0:
        assert all((b * chunk_bytes) & (b * chunk_bytes - 1) == 0 for b in blocks)
    assert len(blocks) <= count * chunk_bytes // PINNED_BLOCK_BYTES + 32  # few allocations


def test_stage_stops_queueing_once_the_version_failed_and_returns_its_buffers():
    pool, log, handed, failed = _pool(8), [], [], []

    def enqueue(unit, buffer):
        if unit == 3:
            failed.append(True)  # a writer failed the version meanwhile
        return Copy(log, unit)

    DeviceCopies(pool, lambda unit, buffer: handed.append(unit)).stage(
        range(10), enqueue, lambda: bool(failed)
    )
    assert handed == [] or handed == sorted(handed)
    assert 4 not in handed and len(handed) < 4
    # every buffer not handed to a writer is back in the pool
    assert sum(pool.try_acquire() is not None for _ in range(8)) == 8 - len(handed)


def test_stage_returns_the_buffer_when_queueing_a_copy_fails():
    pool, log = _pool(2), []

    def enqueue(unit, buffer):
        if unit == 1:
            raise RuntimeError("CUDA error: out of memory")
        return Copy(log, unit)

    handed = []
    with pytest.raises(RuntimeError, match="out of memory"):
        DeviceCopies(pool, lambda unit, buffer: handed.append(unit)).stage(
            range(3), enqueue, lambda: False
        )
    assert handed == [] and sum(pool.try_acquire() is not None for _ in range(2)) == 2


def test_abandon_returns_every_buffer_even_when_the_device_error_is_sticky():
    """After a CUDA error every later wait raises it again: all buffers still go back."""
    pool, log = _pool(8), []
    copies = DeviceCopies(pool, lambda unit, buffer: None)
    for unit in range(4):
        copies.queued(unit, copies.buffer(), Failed(log, unit))
    copies.abandon()
    assert sum(pool.try_acquire() is not None for _ in range(8)) == 8
