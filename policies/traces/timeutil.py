"""Time parsing shared by the trace readers."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from pcframe.policies.errors import TraceFormatError


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


# Ticks are placed by count (tick i at i * step), not by their times: a spacing this far from
# the median would silently drop (a collector's outage) or add (a burst of rows) time. The
# real sources jitter within 0.99-1.44x their median.
GAP_RATIO = 2.0


def median_step(times: np.ndarray, path: Path, lines: list[int] | None = None) -> float:
    """Median spacing of tick times; refuses times that are not finite, not increasing or
    not (roughly) evenly spaced, naming the row and why."""

    def line_of(i: int) -> str:
        return f"line {lines[i] if lines is not None else i + 2}"  # 1-based, after a header

    if not np.isfinite(times).all():
        i = int(np.flatnonzero(~np.isfinite(times))[0])
        raise TraceFormatError(
            path, line_of(i), f"time {times[i]} is not finite", "give every row a real time"
        )
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
        raise TraceFormatError(
            path,
            line_of(int(bad[0]) + 1),
            "time is not strictly increasing",
            "sort the rows by time and remove duplicates",
        )
    step = float(np.median(d))
    uneven = np.flatnonzero((d > GAP_RATIO * step) | (d < step / GAP_RATIO))
    if uneven.size:
        i = int(uneven[0])
        raise TraceFormatError(
            path,
            line_of(i + 1),
            f"{d[i]:g} s after the row before, where the rows are {step:g} s apart (the "
            "median): ticks are placed by count, so the simulation would lose or gain that time",
            "give every step a row (repeat the last known state across a gap, or split the "
            "trace there), or resample it to one spacing",
        )
    return step
