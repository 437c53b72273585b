"""Preemption notice by file: a watcher (cron, sidecar, the simulator) creates a file."""

from __future__ import annotations

import math
import os
import stat
import time
from pathlib import Path

from pcframe.policies.base import Notice
from pcframe.policies.notices.base import NoticeSource
from pcframe.policies.registry import register

# The file holds at most a number; more is not one, and is not read at every poll.
_MAX_BYTES = 4096


@register()
class FileNoticeSource(NoticeSource):
    """A notice is pending while ``path`` exists.

    The file may hold the seconds left (a number) at the time it was written; otherwise
    (no number, content that is not text or cannot be read) ``window`` applies: the file's
    presence is the notice. Only a regular file counts (not a folder or a FIFO). The time
    of the notice is the file's modification time. Stat-ing a file per step is cheap but not
    free, so it is checked at most every ``poll_interval`` seconds of the caller's clock.
    """

    name = "file"

    def __init__(self, path: str, window: float = 120.0, poll_interval: float = 1.0) -> None:
        if not window > 0 or not poll_interval >= 0:  # NaN too: a NaN deadline is never met
            raise ValueError(
                f"window={window}, poll_interval={poll_interval}: window must be > 0 and "
                "poll_interval >= 0 seconds"
            )
        self.path = Path(path)
        self.window = float(window)
        self.poll_interval = float(poll_interval)
        self._checked: float | None = None
        self._cached: tuple[float, float] | None = None  # (wall time written, seconds left)

    def _read(self) -> tuple[float, float] | None:
        try:
            # O_NONBLOCK: a FIFO at the path would block the training thread in open()
            # until a writer came (it has no effect on a regular file).
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError:  # present but not for us to read (another user's file): present
            # is the notice, so only the number is lost. Anything else (its folder is a
            # file, a symlink loop): there is no file to be present.
            return self._stat_only()
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a folder, a FIFO: a watcher writes a file
            os.close(fd)
            return None
        with os.fdopen(fd, "rb") as f:
            try:
                text = f.read(_MAX_BYTES).decode().strip()
                left = float(text) if text else self.window
            except (OSError, ValueError):  # bytes that are not UTF-8, not a number
                left = self.window
        return st.st_mtime, left if math.isfinite(left) and left >= 0 else self.window

    def _stat_only(self) -> tuple[float, float] | None:
        """The notice of a regular file that exists but cannot be opened, with ``window``."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime, self.window) if stat.S_ISREG(st.st_mode) else None

    def poll(self, now: float) -> Notice | None:
        if self._checked is None or not 0 <= now - self._checked < self.poll_interval:
            self._checked = now
            self._cached = self._read()
        if self._cached is None:
            return None
        written, left = self._cached
        received = now - max(time.time() - written, 0.0)
        return Notice(received_at=received, deadline=received + left, source=f"file:{self.path}")

    def reset(self) -> None:
        self._cached = None
        self._checked = None
