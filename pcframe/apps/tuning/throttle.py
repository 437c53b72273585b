"""A disk throttled to a network disk's rate, for real: the cgroup v1 blkio controller.

The kernel's block throttle (``blkio.throttle.write_bps_device`` / ``read_bps_device``)
caps the bytes per second that processes in a cgroup send to one device (``major:minor``).
:class:`BlkioThrottle` makes a child cgroup with those limits and moves this whole process
(every thread: ``cgroup.procs``) into it, and back out and removes it on exit.

What cgroup v1 does and does not throttle (measured by :func:`probe_throttle`, see
``experiments/results/tune_matrix.md``): I/O is charged to the cgroup of the task that
submits it. ``O_DIRECT`` writes and reads (pcframe's default persist path) are submitted by
the writing thread: throttled. Buffered writes only dirty the page cache; the kernel's
flusher threads, which live in the root cgroup, write them back later and are *not*
throttled, unless this process forces them out itself with ``fsync`` / ``fdatasync`` before
the flusher got to them, in which case the part it submits is throttled.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from pcframe.errors import ConfigError

BLKIO = Path("/sys/fs/cgroup/blkio")
WRITE_FILE = "blkio.throttle.write_bps_device"
READ_FILE = "blkio.throttle.read_bps_device"


def block_device_of(path: str | os.PathLike[str]) -> str:
    """``"major:minor"`` of the device holding ``path`` (``"0:N"`` for tmpfs and the like)."""
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def own_blkio_cgroup() -> Path | None:
    """The blkio cgroup folder this process is in, or ``None`` without a v1 blkio hierarchy."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, where = line.split(":", 2)
            if "blkio" in controllers.split(","):
                return BLKIO / where.lstrip("/")
    except (OSError, ValueError):
        return None
    return None


def current_limits(device: str) -> tuple[int | None, int | None]:
    """(write, read) bytes/s this process's blkio cgroup allows on ``device``; None: no limit."""
    group = own_blkio_cgroup()
    if group is None:
        return None, None

    def limit(name: str) -> int | None:
        try:
            for line in (group / name).read_text().splitlines():
                dev, _, value = line.partition(" ")
                if dev == device:
                    return int(value)
        except (OSError, ValueError):
            return None
        return None

    return limit(WRITE_FILE), limit(READ_FILE)


def check_throttle_possible(directory: str | os.PathLike[str], key: str) -> str:
    """The device to throttle for ``directory``; a one-line :class:`ConfigError` if impossible."""
    if not (BLKIO / WRITE_FILE).is_file():
        raise ConfigError(
            f"{key}: this machine has no cgroup v1 blkio throttle ({BLKIO / WRITE_FILE} is "
            "missing, e.g. a cgroup v2 host); pick another target, such as tune/target=disk"
        )
    if os.geteuid() != 0:
        raise ConfigError(
            f"{key}: throttling a disk needs root to create a blkio cgroup (running as uid "
            f"{os.geteuid()}); run as root, or pick another target such as tune/target=disk"
        )
    device = block_device_of(directory)
    if device.startswith("0:"):
        raise ConfigError(
            f"{key}: storage.directory={os.fspath(directory)} is not on a block device "
            f"(device {device}, e.g. tmpfs or overlay) so it cannot be throttled; set "
            "storage.directory to a folder on a real disk, e.g. /var/tmp/pcframe-tune"
        )
    return device


class BlkioThrottle:
    """Run this process with ``write_bps`` / ``read_bps`` on ``device`` while inside ``with``."""

    def __init__(self, device: str, write_bps: int | None, read_bps: int | None) -> None:
        self.device = device
        self.write_bps, self.read_bps = write_bps, read_bps
        self.group = BLKIO / f"pcframe-throttle-{os.getpid()}"
        self._home: Path | None = None

    def __enter__(self) -> BlkioThrottle:
        self._home = own_blkio_cgroup() or BLKIO
        self.group.mkdir(exist_ok=True)
        try:
            if self.write_bps:
                (self.group / WRITE_FILE).write_text(f"{self.device} {self.write_bps}\n")
            if self.read_bps:
                (self.group / READ_FILE).write_text(f"{self.device} {self.read_bps}\n")
            (self.group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError:
            self.group.rmdir()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._home is not None
        (self._home / "cgroup.procs").write_text(f"{os.getpid()}\n")
        # A cgroup can only be removed once empty; children we started have exited by now.
        for _ in range(50):
            try:
                self.group.rmdir()
                return
            except OSError:
                time.sleep(0.02)


@dataclass(frozen=True)
class ProbeResult:
    """Bytes per second of each kind of I/O, as this process sees it (fsync included)."""

    direct_write: float
    buffered_write_fsync: float
    buffered_write_only: float  # dirtying the page cache, no fsync: what the call costs
    direct_read: float

    def lines(self) -> list[str]:
        rows = [
            ("O_DIRECT write + fsync", self.direct_write),
            ("buffered write + fsync", self.buffered_write_fsync),
            ("buffered write, no fsync", self.buffered_write_only),
            ("O_DIRECT read", self.direct_read),
        ]
        return [f"{name}: {rate / 1e6:.0f} MB/s" for name, rate in rows]


def probe_throttle(directory: str | os.PathLike[str], nbytes: int = 32 << 20) -> ProbeResult:
    """Measure the four kinds of I/O on ``directory`` (a scratch file, removed after)."""
    block = 4 << 20
    nbytes = max(block, nbytes // block * block)
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(block))
    path = Path(directory) / f".pcframe-probe-{os.getpid()}.bin"

    def write(direct: bool, sync: bool) -> float:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o600)
        try:
            start = time.perf_counter()
            for offset in range(0, nbytes, block):
                os.pwrite(fd, buffer, offset)
            if sync:
                os.fsync(fd)
            return nbytes / (time.perf_counter() - start)
        finally:
            os.close(fd)
            if not sync:  # leave nothing dirty for the next probe (outside the timing)
                again = os.open(path, os.O_RDONLY)
                os.fsync(again)
                os.close(again)

    def read() -> float:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            start = time.perf_counter()
            for offset in range(0, nbytes, block):
                os.preadv(fd, [buffer], offset)
            return nbytes / (time.perf_counter() - start)
        finally:
            os.close(fd)

    try:
        direct = write(True, True)
        result = ProbeResult(direct, write(False, True), write(False, False), 0.0)
        write(True, True)
        return ProbeResult(
            result.direct_write,
            result.buffered_write_fsync,
            result.buffered_write_only,
            read(),
        )
    finally:
        path.unlink(missing_ok=True)
