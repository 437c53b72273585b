"""When to kill: injected preemption times in wall seconds since the supervised job started."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pcframe.errors import ConfigError


def poisson_times(mtbf: float, count: int, seed: int = 0) -> list[float]:
    """The first ``count`` arrival times of a Poisson process with mean gap ``mtbf`` seconds."""
    if not mtbf > 0:
        raise ConfigError(f"failure.mtbf={mtbf!r} is invalid: give a positive number of seconds")
    rng = random.Random(seed)  # own generator: the schedule does not depend on anything else
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(1.0 / mtbf)
        times.append(now)
    return times


def resolve_trace(path: str | Path) -> Path:
    """``path`` as given (absolute or relative to the working directory), else relative to
    the shipped traces (``$PCFRAME_TRACES`` or ``experiments/traces``)."""
    from pcframe.policies.traces import shared_traces_dir

    candidate = Path(path).expanduser()
    if candidate.is_file():
        return candidate
    try:
        shared, unusable = shared_traces_dir(), ""
    except FileNotFoundError as exc:  # $PCFRAME_TRACES names no folder: was a raw traceback
        shared, unusable = None, f"; {exc}"
    if shared is not None and (shared / candidate).is_file():
        return shared / candidate
    where = f" or under {shared}" if shared is not None else ""
    raise ConfigError(
        f"failure.path={str(path)!r}: no such trace file in the working directory{where}; "
        f"give an existing path, or failure.times=[...] instead{unusable}"
    )


def trace_times(
    path: str | Path | None = None,
    times: Sequence[float] | None = None,
    compression: float = 1.0,
    offset: float = 0.0,
) -> list[float]:
    """Wall-clock kill times from a trace's preemptions (or explicit ``times``).

    Trace time ``t`` maps to wall time ``(t - offset) / compression``; preemptions before
    ``offset`` are dropped. A preemption is a tick at which the trace's up-count drops, as
    defined by :meth:`pcframe.policies.traces.Trace.preemption_ticks`.
    """
    if not compression > 0:
        raise ConfigError(
            f"failure.compression={compression!r} is invalid: give trace seconds per wall "
            "second, > 0 (e.g. 100)"
        )
    if not math.isfinite(offset):  # NaN: every time fails `t >= offset`, no kill at all
        raise ConfigError(
            f"failure.offset={offset!r} is invalid: give the trace seconds to skip, >= 0"
        )
    if (path is None) == (times is None):
        raise ConfigError(
            "failure=trace needs exactly one of failure.path (a trace file) and "
            "failure.times (kill times in trace seconds); set the other to null"
        )
    if times is not None:
        source = sorted(float(t) for t in times)
        # NaN fails every comparison, so `t >= offset` below dropped it without a word;
        # an infinite time is a kill that never comes.
        if not all(math.isfinite(t) and t >= 0 for t in source):
            raise ConfigError(
                f"failure.times={list(times)} is invalid: give kill times in trace seconds, "
                "finite and not negative, e.g. failure.times=[60.0,120.0]"
            )
    else:
        from pcframe.policies.traces import load_trace

        trace = load_trace(resolve_trace(path))
        source = [float(t) for t in trace.preemption_ticks() * trace.step_seconds]
    return [(t - offset) / compression for t in source if t >= offset]


def derived(failure: Any) -> bool:
    """Whether ``failure``'s schedule is derived from this machine's speed: ``mtbf`` (Poisson)
    or ``compression`` (trace) left ``null`` (see :mod:`pcframe.apps.preemption.plan`)."""
    if failure.kind == "poisson":
        return failure.mtbf is None
    if failure.kind == "trace":
        return failure.compression is None
    return False


def kill_times(failure: Any, gap: float | None = None) -> list[float]:
    """Kill schedule of a ``failure`` config node (``kind`` none, poisson or trace).

    A derived schedule (``derived(failure)``) is scaled so that its mean gap between kills
    is ``gap`` seconds; without ``gap`` its times are in units of the mean gap.
    """
    kind = failure.kind
    if kind == "none":
        return []
    if failure.max_kills < 0:
        raise ConfigError(f"failure.max_kills={failure.max_kills} is invalid: use 0 or more")
    if gap is not None and not gap > 0:
        raise ConfigError(f"the mean gap between kills must be positive, got {gap!r}")
    unit = 1.0 if gap is None else gap
    if kind == "poisson":
        mtbf = unit if failure.mtbf is None else failure.mtbf
        return poisson_times(mtbf, failure.max_kills, failure.seed)
    if kind == "trace":
        compression = failure.compression
        scale = 1.0 if compression is None else compression
        times = trace_times(failure.path, failure.times, scale, failure.offset)
        times = times[: failure.max_kills]
        if compression is None and times:
            mean = times[-1] / len(times)
            times = [t / mean * unit for t in times] if mean > 0 else times
        return times
    raise ConfigError(f"failure.kind={kind!r} is unknown; use failure=none, poisson or trace")


def trace_compression(failure: Any, gap: float) -> float:
    """Trace seconds per wall second of a derived trace schedule with mean gap ``gap``."""
    times = trace_times(failure.path, failure.times, 1.0, failure.offset)[: failure.max_kills]
    return (times[-1] / len(times)) / gap if times and times[-1] > 0 else 1.0
