"""Time parsing shared by the trace readers."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from pcframe.policies.traces.errors import TraceFormatError


def parse_time(text: str, path: Path, where: str) -> datetime:
    """ISO 8601 to an aware UTC datetime; a naive stamp is taken as UTC (what the sources use)."""
    try:
        stamp = datetime.fromisoformat(str(text).strip())
    except ValueError as exc:
        raise TraceFormatError(
            path,
            where,
            f"cannot parse time {text!r}",
            "use ISO 8601, e.g. 2023-02-15 22:08:16 or 2025-10-04T00:10:00+00:00",
        ) from exc
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.astimezone(UTC)


def median_step(times: np.ndarray, path: Path, lines: list[int] | None = None) -> float:
    """Median spacing of tick times; refuses non-increasing times (which row, and why)."""
    if times.size < 2:
        raise TraceFormatError(
            path,
            "",
            "a trace needs at least two ticks to know its step",
            "add rows, or use the JSON form with an explicit step_seconds",
        )
    d = np.diff(times)
    bad = np.flatnonzero(d <= 0)
    if bad.size:
        i = int(bad[0]) + 1
        line = lines[i] if lines is not None else i + 2  # +2: 1-based and a header line
        raise TraceFormatError(
            path,
            f"line {line}",
            "time is not strictly increasing",
            "sort the rows by time and remove duplicates",
        )
    return float(np.median(d))
