"""Does the checkpoint's device-to-host copy overlap forward/backward? Two views.

* ``profiler_overlap``: from a torch.profiler (Kineto) Chrome trace, the GPU activity of
  the copy (D2H memcpys, pcframe's Triton gather kernels) against every other kernel
  (forward, backward, optimizer). Overlap = time both run / time the copy runs.
* ``window_overlap``: from host timestamps and CUDA events: the copy's window (save()
  returned .. copy done, seen by a thread waiting on the engine's copy_done) against each
  step's forward/backward window on the GPU (an event pair on the training stream; the
  queue is empty at a step's start because the loop syncs at each step's end).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

COPY_KERNELS = ("_gather_blocks_kernel", "_copy_tiles_kernel")


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, stop in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def is_copy(event: dict[str, Any]) -> bool:
    name = event.get("name", "")
    if event.get("cat") == "gpu_memcpy":
        return "DtoH" in name or "Device -> Pinned" in name or "Device -> Pageable" in name
    return event.get("cat") == "kernel" and any(k in name for k in COPY_KERNELS)


def profiler_overlap(trace: Path | dict[str, Any]) -> dict[str, Any]:
    """Overlap of copy activity with compute kernels in a Kineto Chrome trace (times in us)."""
    data = json.loads(Path(trace).read_text()) if not isinstance(trace, dict) else trace
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"available": False, "reason": "no GPU activity in the trace (CPU run?)"}
    copies = [e for e in gpu if is_copy(e)]
    compute = [e for e in gpu if e.get("cat") == "kernel" and not is_copy(e)]

    def spans(evs: list[dict[str, Any]]) -> list[tuple[float, float]]:
        return union((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs)

    c, k = spans(copies), spans(compute)
    both = intersect(c, k)
    start = min(float(e["ts"]) for e in gpu)
    stop = max(float(e["ts"]) + float(e["dur"]) for e in gpu)
    streams: dict[str, dict[str, float]] = {}
    for e in gpu:
        sid = str(e.get("args", {}).get("stream", "?"))
        s = streams.setdefault(sid, {"events": 0, "busy_ms": 0.0, "copy_events": 0})
        s["events"] += 1
        s["busy_ms"] += float(e["dur"]) / 1e3
        s["copy_events"] += int(is_copy(e))
    return {
        "available": True,
        "window_ms": (stop - start) / 1e3,
        "copy_events": len(copies),
        "copy_busy_ms": length(c) / 1e3,
        "copy_bytes": sum(int(e.get("args", {}).get("bytes", 0) or 0) for e in copies),
        "compute_busy_ms": length(k) / 1e3,
        "overlap_ms": both / 1e3,
        "overlap_fraction_of_copy": both / length(c) if c else None,
        "copy_names": sorted({e["name"][:60] for e in copies})[:4],
        "streams": streams,
    }


def window_overlap(
    copy_window: tuple[float, float], compute_windows: Sequence[tuple[float, float]]
) -> dict[str, Any]:
    """Overlap of one copy window with compute windows (host seconds)."""
    c = union([copy_window])
    k = union(compute_windows)
    total = length(c)
    both = intersect(c, k)
    return {
        "copy_window_s": total,
        "overlap_s": both,
        "overlap_fraction_of_copy": both / total if total > 0 else None,
    }
