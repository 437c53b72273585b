"""Synthetic availability traces with a chosen mean time between preemptions.

For the sensitivity experiment (checkpoint cost x MTBF) and for tests: exponentially
distributed up-times (mean ``mtbf``) alternating with outages (mean ``outage``), sampled on
ticks of ``step_seconds``, in the same :class:`~pcframe.policies.traces.Trace` schema as the
real traces so every part of the simulator treats them alike.
"""

from __future__ import annotations

import math

import numpy as np

from pcframe.errors import SimConfigError
from pcframe.policies.traces import Trace


def poisson_trace(
    mtbf: float,
    hours: float,
    outage: float = 600.0,
    step_seconds: float = 60.0,
    seed: int = 0,
    spot_price: float | None = 1.0,
    on_demand_price: float | None = 3.06,
    name: str | None = None,
) -> Trace:
    """A capacity-1 (availability) trace: up for Exp(mtbf) seconds, down for Exp(outage).

    Every up-period is at least one tick and every outage at least one tick, so each drop is
    a preemption the simulator sees; the realised MTBF (``trace.mtbf()``) is close to
    ``mtbf`` when ``mtbf`` is many ticks long.
    """
    for key, value in (("mtbf", mtbf), ("hours", hours), ("step_seconds", step_seconds)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise SimConfigError(f"poisson_trace: {key}={value!r} must be a finite number > 0")
    if not (math.isfinite(outage) and outage >= 0):
        raise SimConfigError(f"poisson_trace: outage={outage!r} must be seconds >= 0")
    ticks = max(round(hours * 3600.0 / step_seconds), 2)
    rng = np.random.default_rng(seed)
    up = np.zeros(ticks, dtype=np.int64)
    k = 0
    while k < ticks:
        run_up = max(1, round(rng.exponential(mtbf) / step_seconds))
        up[k : k + run_up] = 1
        k += run_up
        k += max(1, round(rng.exponential(outage) / step_seconds)) if outage > 0 else 1
    prices = None if spot_price is None else np.full(ticks, float(spot_price))
    return Trace(
        name=name or f"poisson-mtbf{mtbf:g}s-seed{seed}",
        source="synthetic-poisson",
        step_seconds=float(step_seconds),
        capacity=1,
        up=up,
        spot_price=prices,
        on_demand_price=on_demand_price,
        metadata={"mtbf": mtbf, "outage": outage, "seed": seed},
    )


def steady_trace(
    hours: float,
    step_seconds: float = 60.0,
    capacity: int = 1,
    spot_price: float | None = 1.0,
    on_demand_price: float | None = 3.06,
) -> Trace:
    """Capacity always up: no preemption at all (failure-free runs, tests)."""
    ticks = max(round(hours * 3600.0 / step_seconds), 2)
    return Trace(
        name="always-up",
        source="synthetic-steady",
        step_seconds=float(step_seconds),
        capacity=capacity,
        up=np.full(ticks, capacity, dtype=np.int64),
        spot_price=None if spot_price is None else np.full(ticks, float(spot_price)),
        on_demand_price=on_demand_price,
    )
