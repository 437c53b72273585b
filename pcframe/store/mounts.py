"""The mount table: which file system holds a path, and mounted with which options.

Read from ``/proc/self/mountinfo`` (the calling process's mount namespace). Used to pick the
persist path (DAX mounts get a mapping) and to check that a memory tier is RAM-backed.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

_ESCAPE = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline, \ as \ooo


class Mount(NamedTuple):
    point: str  # mount point
    fs_type: str  # e.g. "ext4", "tmpfs"; "" if the table cannot be read
    options: str  # per-mount options, then the super block's, comma-separated


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str | os.PathLike[str]) -> Mount:
    """The mount holding ``path`` (symlinks resolved): the innermost mount point above it.

    Of several mounts on one point the last one listed wins: it shadows the others. If the
    mount table cannot be read, ``Mount("/", "", "")``.
    """
    target = os.path.realpath(path)
    best = Mount("/", "", "")
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or len(tail) < 3:
            continue
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best.point):
            best = Mount(point, tail[0], f"{fields[5]},{tail[2]}")
    return best


def file_system_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system holding ``path`` (``""`` if unknown)."""
    return mount_of(path).fs_type
