"""Memory tier helpers: a checkpoint directory on tmpfs (``/dev/shm``).

A memory tier is just the Checkpointer's directory on a RAM-backed file system: commits cost
a memory copy (fsync is a no-op there), the version survives a crash of the training process
but not the loss of the machine, so a placement policy pairs it with a disk or remote tier
(``MemoryThenDisk``) and never answers a preemption notice with it alone.
"""

from __future__ import annotations

import os
from pathlib import Path

from pcframe.errors import TierError
from pcframe.store.mounts import file_system_type

SHM = Path("/dev/shm")
_RAM_FS = {"tmpfs", "ramfs"}


def is_memory_backed(path: str | os.PathLike[str]) -> bool:
    return file_system_type(path) in _RAM_FS


def memory_directory(name: str, base: str | os.PathLike[str] = SHM) -> Path:
    """``<base>/pcframe/<name>``: a directory for a memory tier, checked to be RAM-backed.

    Raises:
        TierError: ``base`` is missing or not tmpfs/ramfs (the fix names another base).
    """
    if not name or "/" in name or name in (".", ".."):
        raise TierError(f"memory tier name {name!r}: use a plain directory name, e.g. 'run1'")
    base = Path(base)
    if not base.is_dir() or not is_memory_backed(base):
        raise TierError(
            f"{base} is not a RAM-backed file system ({file_system_type(base) or 'missing'}); "
            "pass base= a tmpfs mount (e.g. /dev/shm) for a memory tier"
        )
    return base / "pcframe" / name
