"""Crash-point injection for crash-consistency tests: a real SIGKILL at a named moment.

Set ``PCFRAME_CRASH_AT=<point>[:<n>]`` and the process kills itself with SIGKILL the n-th
time (default 1st) it passes ``point``. Points in the save path: ``chunk_written``,
``data_synced``, ``manifest_written``, ``published``, ``latest_written``, ``retention``.
With the variable unset this costs one dictionary lookup per call.
"""

from __future__ import annotations

import os
import signal
import threading

_spec = os.environ.get("PCFRAME_CRASH_AT", "")
_point, _, _count = _spec.partition(":")
_remaining = int(_count or 1)
_lock = threading.Lock()


def crash_point(name: str) -> None:
    global _remaining
    if not _point or name != _point:
        return
    with _lock:
        _remaining -= 1
        if _remaining == 0:
            os.kill(os.getpid(), signal.SIGKILL)
