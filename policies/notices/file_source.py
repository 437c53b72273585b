"""Preemption notice by file: a watcher (cron, sidecar, the simulator) creates a file."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from pcframe.policies.base import Notice
from pcframe.policies.notices.base import NoticeSource
from pcframe.policies.registry import register


@register()
class FileNoticeSource(NoticeSource):
    """A notice is pending while ``path`` exists.

    The file may hold the seconds left (a number) at the time it was written; otherwise
    ``window`` applies. The time of the notice is the file's modification time. Stat-ing a
    file per step is cheap but not free, so it is checked at most every ``poll_interval``
    seconds of the caller's clock.
    """

    name = "file"

    def __init__(self, path: str, window: float = 120.0, poll_interval: float = 1.0) -> None:
        if window <= 0 or poll_interval < 0:
            raise ValueError("window must be > 0 and poll_interval >= 0 seconds")
        self.path = Path(path)
        self.window = float(window)
        self.poll_interval = float(poll_interval)
        self._checked: float | None = None
        self._cached: tuple[float, float] | None = None  # (wall time written, seconds left)

    def _read(self) -> tuple[float, float] | None:
        try:
            st = os.stat(self.path)
            text = self.path.read_text().strip()
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            return None
        try:
            left = float(text) if text else self.window
            left = left if math.isfinite(left) and left >= 0 else self.window
        except ValueError:
            left = self.window
        return st.st_mtime, left

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
