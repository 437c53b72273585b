"""Aggregates of historical traces that predictors start from."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pcframe.policies.traces import Trace, load_trace, load_traces

TraceSource = Sequence[Trace] | str | Path | None


def resolve_traces(traces: TraceSource, zone: str | None = None) -> list[Trace]:
    """Traces from a list, a file or a folder (``None``: the shipped traces), of one zone."""
    if traces is None or isinstance(traces, str | Path):
        path = None if traces is None else Path(traces)
        found = [load_trace(path)] if path is not None and path.is_file() else load_traces(path)
    else:
        found = list(traces)
    if zone is not None:
        picked = [t for t in found if t.zone == zone or zone in t.name]
        if not picked:
            zones = sorted({t.zone or t.name for t in found})
            raise ValueError(f"no trace of zone {zone!r}; zones present: {', '.join(zones)}")
        found = picked
    if not found:
        raise ValueError("no traces given: pass a list of Trace, a trace file or a folder")
    return found


def pooled_rate(traces: Sequence[Trace]) -> tuple[float, float]:
    """(preemptions, up-seconds) summed over traces: their ratio is the pooled MLE rate."""
    count = sum(t.preemption_count() for t in traces)
    exposure = sum(t.up_seconds() for t in traces)
    return float(count), float(exposure)


def pooled_availability(traces: Sequence[Trace]) -> tuple[float, float]:
    """(up-fraction-ticks, ticks) summed over traces: their ratio is the mean availability."""
    up = sum(float((t.up / t.capacity).sum()) for t in traces)
    n = sum(t.n_ticks for t in traces)
    return up, float(n)
