"""Where a trial's checkpoints go, and the folders of trials whose process is gone.

A trial measures the engine in ``<storage.directory>/trial-<number>-<host>-<pid>`` and
removes the folder when it ends. A ``pcframe-tune`` killed with SIGKILL (the OOM killer, a
preempted VM) cannot, and its folder holds several checkpoint versions of the workload.
The next run on the same host removes the folders of this host's processes that no longer
run. Several workers may share the folder (a study on a shared file system): a folder of
another host, or of a process that still runs here, is never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

_NAME = re.compile(r"trial-(\d+)-(.+)-(\d+)")


def _host() -> str:
    # Kept to the characters a folder name on any file system takes.
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"


def trial_directory(root: Path, number: int) -> Path:
    """The folder of trial ``number`` run by this process."""
    return root / f"trial-{number}-{_host()}-{os.getpid()}"


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or no such pid
        return True
    return True


def remove_orphaned_trials(root: Path) -> list[Path]:
    """Remove the trial folders under ``root`` left by processes of this host that no longer
    run; the folders removed. A reused pid keeps its folder (the safe side)."""
    host, removed = _host(), []
    try:
        entries = list(root.iterdir())
    except OSError:  # no folder yet
        return removed
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if not match or match[2] != host or _runs(int(match[3])):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
