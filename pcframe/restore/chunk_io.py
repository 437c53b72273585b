"""The reader's I/O: its reading threads, file size checks, the ``preadv`` loop, a chunk
read a window at a time for hashing as it arrives, and :class:`DataFiles` (a version's
``data.bin`` and its stripes, and which file holds a chunk).

The reading threads are started once per thread count and kept (starting them for every
restore cost 50 ms on a loaded 2-core machine); they run torch on one OpenMP thread like
every engine thread (:mod:`pcframe.runtime.threads`), and a forked child forgets its parent's pool.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from pcframe.errors import CorruptCheckpoint, out_of_memory, refused_memory
from pcframe.format.files import open_regular
from pcframe.format.layout import Chunk, Entry
from pcframe.format.manifest import Manifest
from pcframe.format.stripes import stripe_location, stripe_paths, stripe_sizes
from pcframe.format.tree import DTYPES
from pcframe.runtime.threads import single_threaded_torch

_IOV_MAX = 1024
#: bytes read and hashed at a time: small enough to be hashed from the CPU's cache
#: (a quarter of this VM's 1 MiB L2 per core; 64-512 KiB measured alike, 4 MiB slower)
READ_WINDOW = 256 << 10


_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PREFAULT_FROM = 16 * mmap.PAGESIZE  # below this a syscall costs about what it saves


def prefault(view: memoryview) -> bool:
    """Map every whole page of ``view``, new memory about to be read into whole, in one
    call (``MADV_POPULATE_WRITE``) instead of a page fault per 4 KiB as the read reaches it;
    whether it did. Only for a new tensor's own memory (plain anonymous pages).

    A fresh tensor's pages are not mapped until first written: reading 360 MiB into new
    tensors cost 0.23 CPU-s with a fault per page and 0.18 with the pages mapped first
    (this VM, where a fault is dear). Where the kernel cannot (older than 5.14: EINVAL,
    another system), the pages fault in as before; a refused call costs a microsecond."""
    madvise = _libc_madvise()
    if madvise is None or len(view) < _PREFAULT_FROM:
        return False
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + len(view)) // mmap.PAGESIZE * mmap.PAGESIZE
    return end > start and madvise(start, end - start, _MADV_POPULATE_WRITE) == 0


@functools.cache
def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _forget_pools_after_fork() -> None:
    # A forked child has none of the parent's threads: a pool inherited from it would take
    # tasks and never run them.
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_after_fork)


def reading_pool(threads: int) -> ThreadPoolExecutor:
    """The reading threads for ``threads``-way reads, started once and kept.

    Starting threads for every restore cost 50 ms on a loaded 2-core machine (15 thread
    starts, measured), a sixth of a cold restore of 576 MiB.
    """
    with _POOLS_LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = _POOLS[threads] = ThreadPoolExecutor(
                threads, thread_name_prefix="pcframe-read", initializer=single_threaded_torch
            )
        return pool


def fresh_tensor(entry: Entry, path: Path) -> torch.Tensor:
    """A new tensor for ``entry``; an allocation the machine refuses is :func:`out_of_memory`."""
    try:
        return torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
    except (RuntimeError, MemoryError) as exc:  # torch's allocator raises RuntimeError
        if not refused_memory(exc):
            raise
        what = f"tensor {entry.name!r} {list(entry.shape)}"
        raise out_of_memory(what, entry.nbytes, path) from None


def byte_buffer(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, writable, as one flat buffer (it keeps the
    tensor alive); reads slice it per piece without a tensor op each."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def check_size(path: Path, expected: int) -> None:
    """The file is a regular file (not a link, FIFO or device) of the expected size."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: data file is missing") from None
    try:
        actual = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if actual < expected:
        raise CorruptCheckpoint(
            f"{path}: holds {actual} bytes, manifest says {expected} (truncated?)"
        )
    if actual > expected:  # bytes appended (a second writer, a bad copy): not truncated
        raise CorruptCheckpoint(
            f"{path}: holds {actual} bytes, {actual - expected} bytes more than the manifest "
            f"says ({expected}; written to after its commit?)"
        )


def preadv_all(fd: int, buffers: list[memoryview], offset: int, path: Path) -> None:
    """Fill ``buffers`` from consecutive file bytes starting at ``offset`` (handles short reads)."""
    pending = [b for b in buffers if len(b)]
    while pending:
        batch = pending[:_IOV_MAX]
        try:
            got = os.preadv(fd, batch, offset)
        except OSError as exc:  # an I/O error, not corruption: name the file for the user
            raise OSError(
                exc.errno, f"{exc.strerror} (reading at byte {offset})", str(path)
            ) from exc
        if got == 0:
            raise CorruptCheckpoint(f"{path}: unexpected end of file at byte {offset}")
        offset += got
        # Drop fully filled buffers; keep the unread tail of a partially filled one.
        while got and pending:
            head = pending[0]
            if got >= len(head):
                got -= len(head)
                pending.pop(0)
            else:
                pending[0] = head[got:]
                got = 0


_WINDOWS = threading.local()  # one scratch window per reading thread, kept with the thread


def _scratch_window() -> memoryview:
    buffer = getattr(_WINDOWS, "buffer", None)
    if buffer is None or len(buffer) != READ_WINDOW:
        buffer = _WINDOWS.buffer = memoryview(np.empty(READ_WINDOW, dtype=np.uint8))
    return buffer


def read_windows(
    fd: int, path: Path, chunk: Chunk, targets: Mapping[int, memoryview]
) -> Iterator[memoryview]:
    """Read ``chunk`` a window of ``READ_WINDOW`` bytes at a time, yielding each window's
    buffers once they are filled (for a checksum that consumes them in order).

    A piece of an entry in ``targets`` (``{entry: the entry's bytes}``) is read into its
    target; everything else (other entries, padding) into this thread's scratch window,
    which every window reuses: its bytes are only valid until the next window is read.
    """
    scratch = _scratch_window()
    spans: list[tuple[int, int, memoryview | None]] = []  # (start, length, destination)
    cursor = 0
    for piece in chunk.pieces:
        if piece.dst_start > cursor:
            spans.append((cursor, piece.dst_start - cursor, None))
        target = targets.get(piece.entry)
        if target is not None:
            target = target[piece.src_start : piece.src_start + piece.nbytes]
        spans.append((piece.dst_start, piece.nbytes, target))
        cursor = piece.dst_start + piece.nbytes
    if cursor < chunk.length:
        spans.append((cursor, chunk.length - cursor, None))
    window, at = len(scratch), 0
    for begin in range(0, chunk.length, window):
        end = min(begin + window, chunk.length)
        buffers = []
        while at < len(spans):
            start, length, target = spans[at]
            lo, hi = max(start, begin), min(start + length, end)
            if lo < hi:
                if target is None:
                    buffers.append(scratch[lo - begin : hi - begin])
                else:
                    buffers.append(target[lo - start : hi - start])
            if start + length > end:
                break  # continues in the next window
            at += 1
        preadv_all(fd, buffers, chunk.offset + begin, path)
        yield from buffers


class DataFiles:
    """The data files of one version (``data.bin`` and its stripes): their sizes checked on
    construction, their descriptors while open, and which file holds a chunk."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.manifest = manifest
        self.paths = stripe_paths(directory, manifest.stripes)
        sizes = stripe_sizes(manifest.data_size, manifest.chunk_bytes, manifest.stripes)
        for path, size in zip(self.paths, sizes, strict=True):
            check_size(path, size)
        self._fds: list[int] = []

    @property
    def is_open(self) -> bool:
        return bool(self._fds)

    def open(self) -> None:
        try:
            for path in self.paths:
                self._fds.append(open_regular(path))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close every descriptor (idempotent)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def locate(self, chunk: Chunk) -> tuple[int, Path, Chunk]:
        """The descriptor and path of the file holding ``chunk``, and the chunk with its
        offset in that file (the same chunk when the data is not striped)."""
        stripes = self.manifest.stripes
        if stripes == 1:
            return self._fds[0], self.paths[0], chunk
        stripe, local = stripe_location(chunk.offset, self.manifest.chunk_bytes, stripes)
        return self._fds[stripe], self.paths[stripe], replace(chunk, offset=local)
