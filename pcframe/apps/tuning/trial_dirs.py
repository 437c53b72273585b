"""Where a trial's checkpoints go, and the folders of trials whose process is gone.

A trial measures the engine in ``<storage.directory>/trial-<number>-<host>-<pid>`` and
removes the folder when it ends. A ``pcframe-tune`` killed with SIGKILL (the OOM killer, a
preempted VM) cannot, and its folder holds several checkpoint versions of the workload.
While a trial runs, its process holds an ``flock`` on ``<folder>.lock`` beside it; the next
run removes the folders whose lock it can take (the kernel drops a dead process's lock),
so a trial still running is never touched, whatever PID namespace it runs in (containers
sharing a host name). Several hosts may share the folder (a study on a network file
system, where locks may not reach across hosts): only this host's folders are looked at.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from pcframe.runtime.processes import process_alive

_NAME = re.compile(r"trial-(\d+)-(.+)-(\d+)")
LOCK_SUFFIX = ".lock"


def _host() -> str:
    # Kept to the characters a folder name on any file system takes.
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"


def trial_directory(root: Path, number: int) -> Path:
    """The folder of trial ``number`` run by this process."""
    return root / f"trial-{number}-{_host()}-{os.getpid()}"


@contextlib.contextmanager
def held_trial(root: Path, number: int) -> Iterator[Path]:
    """The folder of trial ``number``, locked while the trial runs, removed after it."""
    directory = trial_directory(root, number)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(_lock_of(directory), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(_lock_of(directory))
        os.close(fd)


def _lock_of(directory: Path) -> Path:
    return directory.with_name(directory.name + LOCK_SUFFIX)


def _abandoned(directory: Path) -> bool:
    """Whether no process holds the trial's lock (taken, then left for the removal)."""
    try:
        fd = os.open(_lock_of(directory), os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:  # no lock (yet, or never): its pid decides
        return not process_alive(int(_NAME.fullmatch(directory.name)[3]))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a running trial holds it
    finally:
        os.close(fd)
    return True


def remove_orphaned_trials(root: Path) -> list[Path]:
    """Remove the trial folders under ``root`` that this host's trials left behind (their
    process gone); the folders removed."""
    host, removed = _host(), []
    try:
        entries = list(root.iterdir())
    except OSError:  # no folder yet
        return removed
    for entry in entries:
        folder = entry.with_name(entry.name.removesuffix(LOCK_SUFFIX))
        match = _NAME.fullmatch(folder.name)
        if not match or match[2] != host or entry.is_symlink():
            continue
        if entry.name.endswith(LOCK_SUFFIX):  # a lock whose trial never made its folder
            if not os.path.lexists(folder) and _abandoned(folder):
                with contextlib.suppress(OSError):
                    os.unlink(entry)
            continue
        if entry.is_dir() and _abandoned(entry):
            shutil.rmtree(entry, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.unlink(_lock_of(entry))
            removed.append(entry)
    return removed
