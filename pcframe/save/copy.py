"""The copy stage's kernel: fill one staging buffer from byte ranges of the source tensors.

``copy_backend="torch"`` runs the kernels' torch reference (``Tensor.copy_`` per piece, in
8-byte words where aligned, on the engine's CUDA side stream for GPU tensors). The other
backends go through :mod:`pcframe.kernels`: ``gather`` (Numba copies with the GIL released;
Triton writes straight into pinned memory), and with the ``pcf64`` checksum
``gather_checksum``, which hashes each piece while it is in cache, so the writer does not
read the chunk a second time. A chunk holding a tensor the backend's kernel cannot read goes
to the torch reference instead (:class:`Copier`).

Also here: :class:`SharedChunks`, a version's host chunks taken by the copy thread and a
training thread waiting for it, and :class:`DeviceCopies`, a version's CUDA chunks queued a
few ahead on the side stream.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import pcframe.kernels as kernels
from pcframe.format.layout import PieceTable
from pcframe.kernels.copy import PieceLike, Plan, make_plan, reference
from pcframe.kernels.dispatch import triton_interpreting


class SharedChunks:
    """The host chunks of one version still to be staged, taken one at a time by any thread.

    The copy thread works through them; a training thread that would otherwise wait for the
    copy takes chunks too.
    """

    def __init__(self, write: Any, chunks: Sequence[Any], flats: list[Any]) -> None:
        self.write, self.flats = write, flats
        self._chunks = iter(chunks)
        self._returned: list[Any] = []  # taken, then given back unstaged
        self._busy = 0
        self._closed = False
        self._cond = threading.Condition()

    def take(self) -> Any | None:
        """The next chunk to stage (the caller must call :meth:`done`), or None at the end."""
        with self._cond:
            if self._closed:
                return None
            chunk = self._returned.pop() if self._returned else next(self._chunks, None)
            if chunk is not None:
                self._busy += 1
            return chunk

    def done(self, unstaged: Any | None = None) -> None:
        """A taken chunk is staged, or (``unstaged``) given back for another thread."""
        with self._cond:
            self._busy -= 1
            if unstaged is not None:
                self._returned.append(unstaged)
            self._cond.notify_all()

    def finish(self) -> list[Any]:
        """No more chunks for anyone; once every taken chunk is staged or given back,
        returns the chunks given back after the copy thread stopped taking."""
        with self._cond:
            self._closed = True
            while self._busy:
                self._cond.wait()
            returned, self._returned = self._returned, []
            return returned


class Copier:
    """Fills staging views for one engine; the backend is fixed at construction.

    Which kernel copies a chunk depends on where its tensors live:

    * host memory: with ``auto`` or ``numba``, :meth:`fill_host` from the chunk's address
      table (no per-piece planning, no tensor views): ``auto`` calls libc's ``memmove``
      through ctypes per piece (the GIL released for each copy, about a microsecond of
      Python per piece); ``numba`` copies the whole chunk in one kernel call, the fused
      pcf64 included; ``torch`` copies with ``Tensor.copy_`` per piece (a few microseconds
      of dispatch each, with the GIL, so the two copying threads take turns);
    * CUDA memory: the torch reference on the side stream (the GPU's copy engine, chunks
      queued ahead: :class:`DeviceCopies`), except with ``triton``, which copies them with
      its kernel (measured 0.32x the device-to-host limit on an H200, the copy engine 1.0x:
      ``experiments/results/gpu_h200.md``, so ``auto`` does not pick it).

    ``auto`` does not use Numba: importing it and its compiler holds about 125 MiB more of
    host memory, a fifth of a 0.56 GiB state's staging budget, for a copy the ctypes loop
    does within a few milliseconds of it even for thousands of tensors.
    """

    def __init__(self, backend: str, checksum: str) -> None:
        self.backend = backend
        self.device_kernel = backend == "triton"  # else CUDA chunks take the copy engine
        self.host_kernel = backend in ("numba", "auto")  # fill_host copies host chunks
        self.kernels = backend in ("numba", "triton")  # the public kernels API in fill()
        # A kernel backend computes pcf64 in the copy pass; the other algorithms come from
        # their libraries, a second pass in the writer thread.
        self.fuses_checksum = self.kernels and checksum == "pcf64"
        # Whether two threads may fill buffers at once (the training thread helping the copy
        # thread): Triton kernels of host tensors run in its interpreter, which is not
        # thread-safe.
        self.shareable = backend != "triton"

    def fill_host(
        self, sources: np.ndarray, table: PieceTable, view: torch.Tensor, *, checksum: bool
    ) -> int | None:
        """Copy one chunk of host tensors into the host buffer ``view`` and zero the bytes no
        piece covers (only if :attr:`host_kernel`).

        Args:
            sources: the address of each piece's first byte (its tensor's plus its start).
            table: the chunk's pieces (only ``dst_start`` and ``nbytes`` are read here).
            view: 1-D uint8 host buffer: the chunk's bytes, and its page padding unless
                ``checksum`` (the pcf64 covers the chunk's own bytes).
            checksum: return the pcf64 of all of ``view`` (only if :attr:`fuses_checksum`).
        """
        if self.backend == "auto":
            memmove_gather(sources, table.dst_start, table.nbytes, view)
            return None
        from pcframe.kernels.copy import numba_cpu  # compiled (or read from cache) once

        # The kernels' own Numba gather, on a plan made of the tables (no pieces to plan).
        plan = Plan(sources, table.dst_start, table.nbytes, pieces=[], temps=[])
        if checksum:
            return numba_cpu.gather_checksum(plan, view)[0]()
        numba_cpu.gather(plan, view, zero_fill=True)
        return None

    def fill(
        self, pieces: list[PieceLike], view: torch.Tensor, stream: Any, *, checksum: bool = False
    ) -> int | None:
        """Copy ``pieces`` into ``view`` and zero every byte they do not cover.

        Args:
            pieces: ``(flat uint8 source, byte offset in it, byte offset in view, bytes)``,
                non-overlapping, sorted by buffer offset.
            view: 1-D uint8 host buffer (pinned for GPU sources).
            stream: CUDA side stream that already waits for the training stream, or None.
            checksum: return the pcf64 of all of ``view`` (only if :attr:`fuses_checksum`).

        Returns:
            The pcf64 value when ``checksum`` is set, else ``None``. Either way the bytes are
            in ``view`` when this returns.
        """
        if not self.kernels or not self._kernel_reads(pieces, view):
            # The torch reference reads every kind of memory: a CPU tensor beside CUDA ones
            # (the RNG states, a non-fused optimizer's step counts) takes this path, and its
            # pcf64 is then a second pass over the host buffer.
            self._fill_torch(pieces, view, stream)
            return kernels.checksum(view, "pcf64") if checksum else None
        if checksum:
            done = kernels.gather_checksum(pieces, view, backend=self.backend, stream=stream)
            return done.result()
        kernels.gather(pieces, view, backend=self.backend, zero_fill=True, stream=stream).wait()
        return None

    def _kernel_reads(self, pieces: list[PieceLike], view: torch.Tensor) -> bool:
        """Whether the kernel this backend dispatches to can read every source of ``pieces``
        and write ``view``."""
        sources = [p[0] for p in pieces]
        on_cuda = any(t.is_cuda for t in sources)
        if on_cuda and not self.device_kernel:
            return False  # the copy engine (torch) copies device memory
        if self.backend == "numba":
            return True  # host memory only, here
        if triton_interpreting():
            return True
        # Compiled Triton runs on a CUDA device (a chunk of host tensors alone, pinned or
        # not, has none) and dereferences device pointers: pageable memory is out.
        return on_cuda and all(t.is_cuda or t.is_pinned() for t in [*sources, view])

    @staticmethod
    def enqueue(pieces: list[PieceLike], view: torch.Tensor, stream: Any) -> Any:
        """Queue the torch copy of ``pieces`` into ``view`` on ``stream``; returns its event.

        Host pieces and the zero fill are done on return; ``view`` holds the device bytes
        once the event has completed.
        """
        with torch.cuda.stream(stream):
            reference.gather(make_plan(pieces, view, scatter=False), view, zero_fill=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    @staticmethod
    def _fill_torch(pieces: list[PieceLike], view: torch.Tensor, stream: Any) -> None:
        # The kernels' torch reference, on the engine's side stream as it is (it already
        # waits for the training stream): no second wait, unlike the kernels' public gather.
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            reference.gather(make_plan(pieces, view, scatter=False), view, zero_fill=True)
        if stream is not None and any(source.is_cuda for source, *_ in pieces):
            stream.synchronize()


# Device-to-host copies queued on the side stream ahead of the one the copy thread waits
# for: the copy engine then does not idle while the host hands a staged chunk to a writer
# and queues the next (one chunk at a time ran at 0.6x the D2H limit on an H200).
DEVICE_COPIES_AHEAD = 4


def memmove_gather(
    sources: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray, view: torch.Tensor
) -> None:
    """``memmove`` each range to its offset in the host buffer ``view`` (sorted, not
    overlapping) and zero every byte of ``view`` no range covers. ctypes releases the GIL
    for each call, so the other copying thread runs while one copies."""
    start, length = view.data_ptr(), view.numel()
    memmove, memset, position = ctypes.memmove, ctypes.memset, start
    ranges = zip(sources.tolist(), (offsets + start).tolist(), nbytes.tolist(), strict=True)
    for source, target, size in ranges:
        if target > position:
            memset(position, 0, target - position)
        memmove(target, source, size)
        position = target + size
    if start + length > position:
        memset(position, 0, start + length - position)


# In a version's address table: not looked at yet (the tensors of a chunk are looked at
# when it is first staged, so that work overlaps the copies of earlier chunks).
UNKNOWN_ADDRESS = -2


def host_address(t: torch.Tensor) -> int:
    """The address of ``t``'s first byte where a host kernel may read its bytes as they are
    (a contiguous tensor in host memory whose storage holds all of it), else -1: a raw
    ``memcpy`` has none of the checks ``Tensor.copy_`` makes, so a tensor with a conjugate or
    negative bit (its bytes are not its values) or a storage freed to fewer bytes (``resize_``
    to 0, as sharded training does with gathered parameters) takes the per-piece path, which
    refuses or resolves it."""
    if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return -1
    if t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
        return -1
    return t.data_ptr()


class DeviceCopies:
    """One version's device chunks on their way into pinned buffers, a few queued ahead.

    Args:
        pool: the staging pool the buffers come from.
        hand_off: called with ``(unit, buffer)`` once a queued copy has completed.
    """

    def __init__(self, pool: Any, hand_off: Callable[[Any, torch.Tensor], None]) -> None:
        self.pool, self.hand_off = pool, hand_off
        self._queued: deque[tuple[Any, torch.Tensor, Any]] = deque()

    def stage(
        self,
        units: Sequence[Any],
        enqueue: Callable[[Any, torch.Tensor], Any],
        failed: Callable[[], bool],
    ) -> None:
        """Queue each unit's copy (``enqueue(unit, buffer)`` returns its event) and hand
        every one off in order; stops queueing once ``failed()``, and whatever a failure
        left queued goes back to the pool."""
        try:
            for unit in units:
                if failed():
                    break
                buffer = self.buffer()
                try:
                    event = enqueue(unit, buffer)
                except BaseException:
                    self.pool.release(buffer)
                    raise
                self.queued(unit, buffer, event)
            if not failed():
                self.drain()
        finally:
            self.abandon()

    def buffer(self) -> torch.Tensor:
        """A free staging buffer; while none is free, the oldest queued chunk is handed off
        first (its writer frees a buffer), so waiting never holds buffers back."""
        while self._queued:
            buffer = self.pool.try_acquire()
            if buffer is not None:
                return buffer
            self._hand_off_oldest()
        return self.pool.acquire()

    def queued(self, unit: Any, buffer: torch.Tensor, event: Any) -> None:
        """``unit``'s copy into ``buffer`` is queued (``event`` marks its end)."""
        self._queued.append((unit, buffer, event))
        while self._queued and (
            len(self._queued) > DEVICE_COPIES_AHEAD or self._queued[0][2].query()
        ):
            self._hand_off_oldest()

    def drain(self) -> None:
        """Hand off every queued chunk, in order, as its copy completes."""
        while self._queued:
            self._hand_off_oldest()

    def abandon(self) -> None:
        """After a failure: return what is still queued to the pool, once the device is
        done writing into it. A CUDA error is sticky (every later wait raises it too): each
        buffer still goes back, and the error that stopped the copy is the one raised."""
        while self._queued:
            _, buffer, event = self._queued.popleft()
            try:
                event.synchronize()
            except Exception:
                pass  # the failure that brought us here is already on its way up
            finally:
                self.pool.release(buffer)

    def _hand_off_oldest(self) -> None:
        unit, buffer, event = self._queued.popleft()
        try:
            event.synchronize()
        except BaseException:
            self.pool.release(buffer)
            raise
        self.hand_off(unit, buffer)
