"""Opening the files of a checkpoint: regular files only, never through a link, never blocking.

A checkpoint directory may be on shared or hostile storage. Every file pcframe reads from
it is opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` to be a regular
file before any read, so a FIFO cannot hang a restore, a device (``/dev/zero``) cannot be
read without bound, and a symbolic link cannot point a reader (or a writer) outside the
directory. Such a file is rejected like corruption: :class:`NotRegularFile`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from pcframe.errors import NotRegularFile

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
}


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """Open ``path`` (a regular file, not a link) and return the descriptor.

    Raises:
        NotRegularFile: ``path`` is a symbolic link or not a regular file.
        FileNotFoundError / OSError: as ``os.open`` (the caller decides what missing means).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(
                f"{path}: is a symbolic link; pcframe never follows links inside a checkpoint "
                "directory (copy the file in its place)"
            ) from None
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing without a reader
            raise NotRegularFile(f"{path}: is a FIFO, not a regular file") from None
        raise
    try:
        mode_bits = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode_bits):
            kind = _KINDS.get(stat.S_IFMT(mode_bits), "not a regular file")
            raise NotRegularFile(f"{path}: is {kind}, not a regular file; remove it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: str | os.PathLike[str], limit: int) -> bytes:
    """At most ``limit`` bytes of a regular file (a bounded read, e.g. for LATEST)."""
    fd = open_regular(path)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def is_real_directory(path: Path) -> bool:
    """A directory that is not a symbolic link (versions pointing elsewhere are refused)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
