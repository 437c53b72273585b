"""A bounded pool of page-aligned host buffers, one checkpoint chunk each.

Host memory for checkpointing never grows past the pool's budget: when every buffer is in
use (writers are behind), the copy stage waits for one to come back. That wait is the
engine's backpressure, and it is measured as training stall when it delays a step.

The pool also decides who goes first when the training thread is blocked on a snapshot
(its optimizer step waits in the gate): the copy. Measured on a 2-core host, a 576 MiB
snapshot copy took 0.05-0.09 s while four writers checksummed and wrote the chunks already
staged, and 0.035 s (one memcpy: 0.03 s) when they held off until it was done: the writers
compete for the same cores and memory bandwidth. So while :meth:`StagingPool.training_waits`
is active, a writer about to start a chunk waits, unless the copy itself waits for a
buffer back. (Releasing the writers when the last free buffer was taken instead let four
of them start while the copy still filled it: 1-5 ms more stall, measured.) When training
is not blocked, copy and writes overlap as before.

A buffer a writer gives back after writing a raw chunk still holds that chunk's bytes, and
the pool remembers which (``release(buffer, holds=(version, chunk))``) until the buffer is
handed out again or the pool is reallocated. A rollback to the newest version this process
saved then reads the chunks the pool still holds from memory, after checking each against
its checksum (:meth:`StagingPool.holding`; :mod:`pcframe.restore.staged`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import torch

from pcframe.config import PAGE

# torch's pinned-memory allocator rounds every allocation up to a power of two: one 12 GiB
# pool held 16 GiB of pinned memory on an H200 (experiments/results/gpu_h200.md). So a pinned
# pool is allocated in blocks of at most this size, each a power-of-two number of chunks.
PINNED_BLOCK_BYTES = 1 << 30


def pinned_blocks(count: int, chunk_bytes: int) -> list[int]:
    """How many chunks each pinned allocation of a ``count``-chunk pool holds.

    Full blocks of ``PINNED_BLOCK_BYTES // chunk_bytes`` chunks, then the rest split into
    powers of two (its binary digits). With a power-of-two ``chunk_bytes`` (the default 16
    MiB) every block is a power of two in bytes, so the allocator rounds nothing up.
    """
    per_block = max(1, PINNED_BLOCK_BYTES // chunk_bytes)
    full, rest = divmod(count, per_block)
    blocks = [per_block] * full
    while rest:
        part = 1 << (rest.bit_length() - 1)
        blocks.append(part)
        rest -= part
    return blocks


class StagingPool:
    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._cond = threading.Condition()
        self._free: list[torch.Tensor] = []
        self._count = 0
        self._out = 0
        self._pinned = False
        self._closed = False
        self._training_waits = 0  # training-thread waits in progress (copy goes first)
        self._sized_by_save = False  # a save's ensure has sized the pool (ahead ones yield)
        # Threads waiting in acquire() for a buffer to come back: a set of thread ids, not a
        # count, so an interrupt inside acquire cannot leave it off by one for good.
        self._acquiring: set[int] = set()
        # Free buffers that still hold a raw chunk, oldest given back first, by data_ptr (the
        # others are in _free), and what each buffer (free or lent) holds: (version, chunk).
        self._held: dict[int, torch.Tensor] = {}
        self._holds: dict[int, tuple[int, int]] = {}

    @property
    def capacity_bytes(self) -> int:
        return self._count * self.chunk_bytes

    def ensure(self, budget_bytes: int, pinned: bool, *, touch: bool = False) -> None:
        """Size the pool to ``budget_bytes`` (rounded down to whole chunks, at least one).

        Reallocates only while no buffer is out, so a resize never races a copy in progress.
        ``touch`` faults every page in now (for an allocation ahead of the first save: the
        copy then writes into resident memory), before any buffer can be handed out.

        Raises:
            MemoryError: the allocation was refused (no pool until a later save allocates one).
        """
        count = max(1, budget_bytes // self.chunk_bytes)
        with self._cond:
            if not touch:
                self._sized_by_save = True
            elif self._sized_by_save:
                return  # ahead of the first save, but a save has sized the pool meanwhile
            if self._closed or (count == self._count and pinned == self._pinned):
                return
            if self._out:
                return  # try again at a later save
            self._free, self._held, self._holds = [], {}, {}  # the old pool goes first
            try:
                self._free = self._allocate(count, pinned)
                if touch and not pinned:  # pinned memory is resident once allocated
                    for buffer in self._free:
                        buffer.numpy()[::PAGE] = 0  # one write per page faults it in
            except (MemoryError, RuntimeError) as exc:  # numpy / torch refuse the allocation
                self._free, self._count = [], 0  # no pool now: the next save allocates again
                self._cond.notify_all()  # a queued version's copy fails instead of waiting
                # Memory, not configuration: the same knobs may work at the next save.
                raise MemoryError(
                    f"cannot allocate a staging pool of {count * self.chunk_bytes} bytes "
                    f"({type(exc).__name__}): free host memory, or lower engine.staging_bytes "
                    "or engine.staging_ratio (1.0 stages one whole version)"
                ) from None
            self._count, self._pinned = count, pinned

    def _allocate(self, count: int, pinned: bool) -> list[torch.Tensor]:
        total = count * self.chunk_bytes
        if pinned:
            return [
                buffer
                for chunks in pinned_blocks(count, self.chunk_bytes)
                for buffer in torch.empty(
                    chunks * self.chunk_bytes, dtype=torch.uint8, pin_memory=True
                ).split(self.chunk_bytes)
            ]
        else:
            # Over-allocate one page and start at the first page boundary: O_DIRECT needs
            # page-aligned buffers, and numpy gives no alignment guarantee.
            raw = np.empty(total + PAGE, dtype=np.uint8)
            start = (-raw.ctypes.data) % PAGE
            block = torch.from_numpy(raw[start : start + total])
        return list(block.split(self.chunk_bytes))

    def acquire(self) -> torch.Tensor:
        with self._cond:
            me = threading.get_ident()
            # Left here only by an interrupt landing at this thread's last `finally` below.
            self._acquiring.discard(me)
            if not self._available() and not self._closed and self._count:
                try:
                    self._acquiring.add(me)
                    self._cond.notify_all()  # held writers: the copy needs a buffer back
                    while not self._available() and not self._closed and self._count:
                        self._cond.wait()
                finally:
                    self._acquiring.discard(me)
            if self._closed:
                raise RuntimeError("staging pool is closed")
            if not self._available():  # none will come back: the pool could not be allocated
                raise RuntimeError("no staging pool: its allocation was refused at a later save")
            return self._hand_out()

    def _available(self) -> int:
        return len(self._free) + len(self._held)

    def _hand_out(self) -> torch.Tensor:
        """A free buffer, out (its bytes about to be overwritten: it holds no chunk). One that
        holds none if any, else the one given back first (the oldest version's chunk): the
        last one given back, as a stack takes it, wrote a version's later chunks over its
        first ones, so a pool as large as a version kept only two thirds of it (measured)."""
        buffer = self._free.pop() if self._free else self._held.pop(next(iter(self._held)))
        self._holds.pop(buffer.data_ptr(), None)
        self._out += 1
        return buffer

    def try_acquire(self) -> torch.Tensor | None:
        """A free buffer at once, or None: never waits (the caller has buffers to hand off)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("staging pool is closed")
            if not self._available():
                return None
            return self._hand_out()

    def release(self, buffer: torch.Tensor, holds: tuple[int, int] | None = None) -> None:
        """Give ``buffer`` back; ``holds``: the ``(version, chunk index)`` of the raw chunk
        whose bytes it holds (written as they are), for a rollback read from memory."""
        with self._cond:
            self._out -= 1
            if buffer.numel() == self.chunk_bytes and self._available() < self._count:
                if holds is None:
                    self._free.append(buffer)
                else:
                    self._held[buffer.data_ptr()] = buffer
                    self._holds[buffer.data_ptr()] = holds
            self._cond.notify_all()

    def holding(self, lent: list[torch.Tensor]) -> dict[int, dict[int, torch.Tensor]]:
        """``{version: {chunk index: buffer}}`` of the chunks the ``lent`` buffers hold (call
        while they are lent: nothing else writes them then)."""
        held: dict[int, dict[int, torch.Tensor]] = {}
        with self._cond:
            for buffer in lent:
                if (tag := self._holds.get(buffer.data_ptr())) is not None:
                    held.setdefault(tag[0], {})[tag[1]] = buffer
        return held

    def forget(self) -> None:
        """The free buffers were written over (a restore's spare memory): they hold no chunk."""
        with self._cond:
            self._holds.clear()
            self._free.extend(self._held.values())
            self._held.clear()

    @contextlib.contextmanager
    def lend(self) -> Iterator[list[torch.Tensor]]:
        """Every buffer, for the duration, while no save uses the pool (a restore keeps the
        live bytes it overwrites there: :mod:`pcframe.restore.live`); none when a buffer
        is out, the pool is closed or not allocated, or being allocated right now (then
        the restore reads the old way rather than wait for the pages to be faulted in)."""
        lent: list[torch.Tensor] = []
        if self._cond.acquire(blocking=False):
            try:
                if not self._closed and not self._out:
                    lent = self._free + list(self._held.values())
                    self._free, self._held = [], {}
                    self._out = len(lent)
            finally:
                self._cond.release()
        try:
            yield list(lent)
        finally:
            with self._cond:
                self._out -= len(lent)
                for buffer in lent if not self._closed else ():
                    if buffer.data_ptr() in self._holds:  # oldest first, as they were
                        self._held[buffer.data_ptr()] = buffer
                    else:
                        self._free.append(buffer)
                self._cond.notify_all()

    @contextlib.contextmanager
    def training_waits(self) -> Iterator[None]:
        """While the training thread waits for a snapshot: writers let the copy go first."""
        with self._cond:
            self._training_waits += 1
        try:
            yield
        finally:
            with self._cond:
                self._training_waits -= 1
                self._cond.notify_all()

    def writer_turn(self) -> None:
        """Called by a writer before it starts a staged chunk: wait while the copy goes first.

        Waits only while the training thread is blocked on a copy that is not itself
        waiting for a buffer: once it is, it needs this writer to free one.
        """
        with self._cond:
            while self._training_waits and not self._acquiring and not self._closed:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._free.clear()
            self._held.clear()
            self._holds.clear()
            self._cond.notify_all()
