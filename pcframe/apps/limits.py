"""The machine's own limits for a checkpoint: how fast memory copies, how fast the disk writes.

A checkpointing engine cannot snapshot faster than one memcpy of the state, nor make it
durable faster than the disk takes synced writes. The benchmarks and ``pcframe-tune`` state
their results as ratios to these numbers, measured in the same run:

* **memcpy**: copying ``nbytes`` between two buffers already faulted in, with torch's
  ``copy_`` on the calling thread's threads (the fastest copy this process can do) and on
  one thread (what one engine thread can do);
* **disk write**: ``nbytes`` written with ``O_DIRECT`` in large requests (16 and 64 MiB, the
  faster counts) and fsynced, by 1 and by 4 parallel writers (the best of them is the
  limit; both are reported, since the better one depends on the device). Where ``O_DIRECT``
  is refused (tmpfs), buffered writes + fsync;
* **disk read**: the same file read back cold by 4 parallel readers, with ``O_DIRECT`` and
  buffered (its pages dropped first), the fastest request size and mode: what a cold
  restore can get at best.

Each number is the median of ``repeats``; the spread (min..max) comes with it, because a
shared machine drifts.
"""

from __future__ import annotations

import mmap
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pcframe.runtime.threads import single_threaded_torch
from pcframe.save.persist import pwrite_all

BLOCK = 64 << 20  # the largest request; sizes are rounded up to whole blocks of it
BLOCKS = (16 << 20, 64 << 20)  # request sizes tried: the faster one is the disk's (virtual
# disks here were faster with 16 MiB requests, some devices are with larger ones)


@dataclass(frozen=True)
class Throughput:
    """Bytes per second: median and spread over repeats."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, nbytes: int, seconds: list[float]) -> Throughput:
        rates = [nbytes / s for s in seconds]
        return cls(statistics.median(rates), min(rates), max(rates))

    def text(self) -> str:
        return f"{self.median / 1e9:.2f} GB/s ({self.low / 1e9:.2f}..{self.high / 1e9:.2f})"


@dataclass(frozen=True)
class MachineLimits:
    nbytes: int
    memcpy: Throughput  # torch copy_ with this thread's OpenMP threads
    memcpy_one_thread: Throughput
    disk_write_1: Throughput  # one O_DIRECT writer, fsync included
    disk_write_4: Throughput  # four parallel writers
    disk_read: Throughput  # four parallel O_DIRECT readers (buffered where O_DIRECT is refused)
    direct: bool  # O_DIRECT was used (False: buffered + fsync)

    @property
    def disk_write(self) -> Throughput:
        """The better of 1 and 4 writers: the disk's limit."""
        return max(self.disk_write_1, self.disk_write_4, key=lambda r: r.median)

    def memcpy_seconds(self, nbytes: int) -> float:
        return nbytes / self.memcpy.median

    def disk_seconds(self, nbytes: int) -> float:
        return nbytes / self.disk_write.median

    def read_seconds(self, nbytes: int) -> float:
        return nbytes / self.disk_read.median

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        return [
            f"memcpy ({torch.get_num_threads()} threads): {self.memcpy.text()}; "
            f"one thread: {self.memcpy_one_thread.text()}",
            f"disk write ({'O_DIRECT' if self.direct else 'buffered'} + fsync, "
            f"{'/'.join(str(b >> 20) for b in BLOCKS)} MiB requests): "
            f"1 writer {self.disk_write_1.text()}, "
            f"4 writers {self.disk_write_4.text()}",
            "disk read (cold, 4 readers, the better of O_DIRECT and buffered): "
            f"{self.disk_read.text()}",
        ]


def measure_limits(
    directory: str | os.PathLike[str], nbytes: int, repeats: int = 5
) -> MachineLimits:
    """Measure memcpy and disk-write limits for ``nbytes`` (a temporary file in ``directory``)."""
    nbytes = max(BLOCK, -(-nbytes // BLOCK) * BLOCK)
    memcpy, one = copy_times(nbytes, repeats)
    path = Path(directory) / f".pcframe-limits-{os.getpid()}.bin"
    try:
        direct = _opens_direct(path)
        writes = {
            n: _best(
                nbytes,
                [
                    [write_seconds(path, nbytes, n, b, direct) for _ in range(repeats)]
                    for b in BLOCKS
                ],
            )
            for n in (1, 4)
        }
        # O_DIRECT and buffered (the file's pages dropped first): on some virtual disks the
        # kernel's readahead beats direct requests.
        modes = (direct, False) if direct else (False,)
        reads = _best(
            nbytes,
            [
                [cold_read_seconds(path, nbytes, 4, b, mode) for _ in range(repeats)]
                for b in BLOCKS
                for mode in modes
            ],
        )
    finally:
        path.unlink(missing_ok=True)
    return MachineLimits(
        nbytes,
        Throughput.of(nbytes, memcpy),
        Throughput.of(nbytes, one),
        writes[1],
        writes[4],
        reads,
        direct,
    )


def copy_times(nbytes: int, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per copy of ``nbytes``: with this thread's OpenMP threads, and on one thread."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # both faulted in: the copy alone is timed
    many = copy_seconds(dst, src, repeats)
    one: list[float] = []

    def one_thread() -> None:
        single_threaded_torch()
        one.extend(copy_seconds(dst, src, repeats))

    worker = threading.Thread(target=one_thread)
    worker.start()
    worker.join()
    return many, one


def copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> list[float]:
    """Seconds per ``dst.copy_(src)``, ``repeats`` times (buffers the caller keeps, so a
    benchmark can time the same copy again and again without faulting new memory)."""
    return [_timed(lambda: dst.copy_(src)) for _ in range(repeats)]


def _best(nbytes: int, candidates: list[list[float]]) -> Throughput:
    """The fastest (by median) of several request sizes' measurements."""
    return max((Throughput.of(nbytes, seconds) for seconds in candidates), key=lambda t: t.median)


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _opens_direct(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    return True


def write_seconds(path: Path, nbytes: int, writers: int, size: int, direct: bool) -> float:
    """Seconds to write ``nbytes`` with ``writers`` threads in ``size`` requests, then fsync."""
    block = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(1 << 20) * (size >> 20))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        offsets = range(0, nbytes, size)
        start = time.perf_counter()
        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(lambda offset: pwrite_all(fd, memoryview(block), offset), offsets))
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def cold_read_seconds(
    path: Path, nbytes: int, readers: int, size: int, direct: bool = False
) -> float:
    """Seconds to read ``nbytes`` of ``path`` cold with ``readers`` threads in ``size``
    requests (buffered: the file's clean pages are dropped first)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    offsets = list(range(0, nbytes, size))

    def reader(k: int) -> None:
        buffer = mmap.mmap(-1, size)  # page-aligned, one per reader
        for offset in offsets[k::readers]:
            os.preadv(fd, [buffer], offset)

    try:
        if not direct:  # cold: the file's pages (clean after its fsync) are dropped first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        with ThreadPoolExecutor(readers) as pool:
            list(pool.map(reader, range(readers)))
        return time.perf_counter() - start
    finally:
        os.close(fd)
