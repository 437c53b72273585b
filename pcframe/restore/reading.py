"""The reader's I/O: its reading threads, file size checks and the ``preadv`` loop.

The reading threads are started once per thread count and kept (starting them for every
restore cost 50 ms on a loaded 2-core machine); they run torch on one OpenMP thread like
every engine thread (:mod:`pcframe.threads`), and a forked child forgets its parent's pool.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pcframe.errors import CorruptCheckpoint
from pcframe.format.files import open_regular
from pcframe.threads import single_threaded_torch

_IOV_MAX = 1024


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
    if actual != expected:
        raise CorruptCheckpoint(
            f"{path}: holds {actual} bytes, manifest says {expected} (truncated?)"
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
