"""Readers for event and sampled-count traces: Bamboo (NSDI '23) and PCcheck (ASPLOS '25)."""

from __future__ import annotations

import csv
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from pcframe.policies.errors import TraceFormatError
from pcframe.policies.traces.native import EPOCH_MILLISECONDS
from pcframe.policies.traces.schema import MAX_DURATION, Trace
from pcframe.policies.traces.timeutil import median_step

# An event trace is resampled to one tick per step: a stray huge time would allocate
# gigabytes (3e12 ms: 50 million ticks). 10 million is 19 years at the default minute.
MAX_RESAMPLED_TICKS = 10_000_000


def read_bamboo_events(
    path: Path, step_seconds: float = 60.0, capacity: int | None = None
) -> Trace:
    """``ms_offset,add|remove,nodeN`` rows, resampled to the up-count every ``step_seconds``.

    Tick i holds the count after every event at or before ``i * step_seconds``; where a
    ``remove`` within the tick left fewer VMs than both that count and the next tick's show
    (a node removed and added back within one tick, or replaced at the same instant), the
    tick holds that lower count: a preemption, not lost between two samples. The shipped
    traces put all events on whole minutes, so the default 60 s step loses nothing there.
    """
    if step_seconds <= 0:
        raise ValueError(f"step_seconds={step_seconds} must be > 0")
    up_nodes: set[str] = set()
    times: list[int] = []
    counts: list[int] = []
    removals: list[tuple[int, int]] = []  # (time, count just after) of each remove
    last = -1
    with path.open(newline="", encoding="utf-8-sig") as f:
        for lineno, row in enumerate(csv.reader(f), start=1):
            if not row:
                continue
            if len(row) != 3 or row[1].strip() not in ("add", "remove"):
                raise TraceFormatError(
                    path,
                    f"line {lineno}",
                    f"expected 'ms,add|remove,node', got {row}",
                    "each row is <milliseconds>,add|remove,<node name>",
                )
            try:
                ms = int(row[0])
            except ValueError as exc:
                raise TraceFormatError(
                    path,
                    f"line {lineno}",
                    f"time {row[0]!r} is not integer milliseconds",
                    "write the offset in whole milliseconds",
                ) from exc
            if ms < last:
                raise TraceFormatError(
                    path,
                    f"line {lineno}",
                    f"time {ms} ms goes back from {last} ms",
                    "sort the events by time",
                )
            node, action = row[2].strip(), row[1].strip()
            if action == "add":
                if node in up_nodes:
                    raise TraceFormatError(
                        path,
                        f"line {lineno}",
                        f"{node} added while already up",
                        "remove the duplicate 'add' or the missing 'remove' before it",
                    )
                up_nodes.add(node)
            else:
                if node not in up_nodes:
                    raise TraceFormatError(
                        path,
                        f"line {lineno}",
                        f"{node} removed but it is not up",
                        "add the node before removing it",
                    )
                up_nodes.discard(node)
                removals.append((ms, len(up_nodes)))
            last = ms
            times.append(ms)
            counts.append(len(up_nodes))
    if not times:
        raise TraceFormatError(path, "", "no events", "add at least one 'add' event")
    step_ms = step_seconds * 1000.0
    if times[-1] / 1000.0 > MAX_DURATION:  # before allocating one tick per step of it
        raise TraceFormatError(
            path,
            "",
            f"the last event is at {times[-1]:g} ms, over {MAX_DURATION:.0f} s (100 years)",
            "give event times in milliseconds from the start",
        )
    n = int(times[-1] // step_ms) + 1
    if n > MAX_RESAMPLED_TICKS:  # each tick costs ~40 bytes while resampling: refuse first
        raise TraceFormatError(
            path,
            "",
            f"the last event, at {times[-1]:g} ms, makes {n:,} ticks of {step_seconds:g} s "
            f"(at most {MAX_RESAMPLED_TICKS:,})",
            "check that times are milliseconds from the trace's start, or resample with a "
            "longer step (step_seconds)",
        )
    # Count after the last event at or before each tick: searchsorted over event times.
    idx = np.searchsorted(np.asarray(times), np.arange(n) * step_ms, side="right") - 1
    up = np.where(idx >= 0, np.asarray(counts)[np.maximum(idx, 0)], 0)
    if removals:  # a dip neither its tick's sample nor the next one shows: kept
        at, after = np.asarray(removals).T
        low = np.full(n, np.iinfo(np.int64).max)
        np.minimum.at(low, (at // step_ms).astype(np.int64), after)
        shown = np.minimum(up, np.append(up[1:], up[-1]))  # this tick's and the next sample
        up = np.where(low < shown, low, up)
    cap = capacity or max(counts)
    return Trace(
        name=path.stem,
        source="bamboo",
        step_seconds=step_seconds,
        capacity=cap,
        up=up,
        path=str(path),
        metadata={"events": len(times)},
    )


def read_pccheck_gpus(path: Path, gpus_per_vm: int = 4, capacity: int | None = None) -> Trace:
    """``,Time,GPUs`` rows (unix time, GPUs up) from the PCcheck artifact; 4 GPUs per VM."""
    times: list[float] = []
    gpus: list[int] = []
    lines: list[int] = []
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [c.strip() for c in header][-2:] != ["Time", "GPUs"]:
            raise TraceFormatError(
                path,
                "line 1",
                f"header {header} is not ',Time,GPUs'",
                "use the PCcheck gpus_trace.csv layout or the pcframe CSV form",
            )
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                times.append(float(row[-2]))
                gpus.append(int(row[-1]))
            except (ValueError, IndexError) as exc:
                raise TraceFormatError(
                    path,
                    f"line {lineno}",
                    f"bad row {row}: {exc}",
                    "each row is <index>,<unix seconds>,<GPUs up>",
                ) from exc
            if gpus[-1] < 0:
                raise TraceFormatError(
                    path, f"line {lineno}", f"negative GPU count {gpus[-1]}", "use counts >= 0"
                )
            if not 0 <= times[-1] < EPOCH_MILLISECONDS[0]:  # datetime would say "year 55840"
                raise TraceFormatError(
                    path, f"line {lineno}",
                    f"time {times[-1]:.0f} is not unix seconds between 1970 and the year 5000"
                    + (" (milliseconds?)" if times[-1] >= EPOCH_MILLISECONDS[0] else ""),
                    "write the Time column in seconds since the epoch",
                )  # fmt: skip
            lines.append(lineno)
    step = median_step(np.asarray(times), path, lines)
    return Trace(
        name=path.stem,
        source="pccheck",
        step_seconds=step,
        capacity=capacity or max(max(gpus), 1),
        up=np.asarray(gpus, dtype=np.int64),
        start_time=datetime.fromtimestamp(times[0], tz=UTC),
        unit="gpu",
        units_per_vm=gpus_per_vm,
        path=str(path),
    )
