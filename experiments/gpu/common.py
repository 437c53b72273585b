"""Helpers shared by the GPU benchmark parts: budgets, statistics, JSON files, memory."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def log(*parts: Any) -> None:
    """Print with a timestamp, flushed (the device returns only what reached stdout)."""
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


class Budget:
    """A wall-clock deadline for one part, so a slow part cannot eat the others' time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()
        self.deadline = self.start + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.start

    def enough(self, seconds: float) -> bool:
        return self.left() >= seconds


def stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median with spread (min, max, quartiles) of repeated measurements."""
    xs = sorted(float(v) for v in values if v is not None and math.isfinite(v))
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None}
    if len(xs) >= 2:
        q = statistics.quantiles(xs, n=4, method="inclusive")
        q1, q3 = q[0], q[2]
    else:
        q1 = q3 = xs[0]
    return {
        "n": len(xs),
        "median": statistics.median(xs),
        "min": xs[0],
        "max": xs[-1],
        "q1": q1,
        "q3": q3,
    }


def write_json(path: Path, data: Any) -> None:
    """Write atomically (a killed part leaves the previous complete file, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def proc_status(field: str) -> int:
    """A byte count from /proc/self/status (VmRSS, VmHWM, VmLck, ...); 0 if unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs 5); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def free_bytes(path: str | os.PathLike[str]) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def gib(n: float | None) -> float | None:
    return None if n is None else n / 2**30


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def python_info() -> dict[str, str]:
    return {"python": sys.version.split()[0], "executable": sys.executable}
