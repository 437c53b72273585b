"""Leave-one-zone-out machinery of the simulator experiments.

For every shipped trace the policy under test is built from history that excludes the
trace's zone (a new zone the user has no trace of): :func:`history_for`. The single-run
fixed-interval curves (each trace simulated once, the simulator's ``best_fixed_interval``
search, the interval chosen in advance) are what ``hindsight_phase.py`` measures phase
luck on; experiment 5 itself uses the seed-averaged yardstick of ``seeded.py``. The curves
do not depend on the policy under test, so they are cached.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from profiles import job_for

import pcframe.policies as P
from pcframe.policies.traces import Trace
from pcframe.sim import Oracle, simulate
from pcframe.sim.baselines import best_fixed_interval

# Fixed intervals tried in advance: seconds of training, 20 s to 12 h, geometric.
SECONDS_GRID = [float(x) for x in np.geomspace(20.0, 12 * 3600.0, 36)]


def zone_of(trace: Trace) -> str:
    """Traces without a zone (Bamboo, PCcheck) are each their own zone."""
    return trace.zone or f"{trace.source}/{trace.name}"


def key_of(trace: Trace) -> str:
    return f"{trace.source}/{trace.name}/{trace.capacity}"


def history_for(trace: Trace, traces: Sequence[Trace]) -> list[Trace]:
    """Every trace of another zone: the history a user deploying in ``trace``'s zone has."""
    zone = zone_of(trace)
    return [t for t in traces if zone_of(t) != zone]


@dataclass
class FixedCurves:
    """Per (regime, trace): goodput at every interval of SECONDS_GRID, the hindsight best."""

    grid: dict[str, list[float]]
    hindsight: dict[str, float]
    hindsight_every: dict[str, int]
    oracle: dict[str, float]

    def in_advance(self, regime: str, trace: Trace, traces: Sequence[Trace]) -> tuple[float, float]:
        """(goodput on ``trace``, seconds) of the grid interval best on average over the
        other zones' traces."""
        others = [key_of(t) for t in history_for(trace, traces)]
        scores = []
        for i in range(len(SECONDS_GRID)):
            rel = [self.grid[f"{regime}|{k}"][i] / self.hindsight[f"{regime}|{k}"] for k in others]
            scores.append(statistics.fmean(rel))
        best = int(np.argmax(scores))
        return self.grid[f"{regime}|{key_of(trace)}"][best], SECONDS_GRID[best]


def compute_curves(traces: Sequence[Trace], regimes: Sequence[str]) -> FixedCurves:
    grid: dict[str, list[float]] = {}
    hind: dict[str, float] = {}
    every: dict[str, int] = {}
    oracle: dict[str, float] = {}
    for regime in regimes:
        for trace in traces:
            job = job_for(trace, regime)
            it = job.step_time(trace.capacity)
            key = f"{regime}|{key_of(trace)}"

            def run(policy: P.IntervalPolicy, trace: Trace = trace, job=job):
                return simulate(trace, policy, job)

            grid[key] = [run(P.FixedSteps(max(1, round(s / it)))).goodput for s in SECONDS_GRID]
            e, result, _ = best_fixed_interval(run, job, trace.duration)
            hind[key], every[key] = result.goodput, e
            oracle[key] = run(Oracle()).goodput
    return FixedCurves(grid, hind, every, oracle)


def fixed_curves(traces: Sequence[Trace], regimes: Sequence[str], cache: str | None) -> FixedCurves:
    """The fixed-interval curves, kept between runs in ``cache`` (a JSON file) if given."""
    if cache:
        return load_or_compute(Path(cache), traces, regimes)
    return compute_curves(traces, regimes)


def load_or_compute(path: Path, traces: Sequence[Trace], regimes: Sequence[str]) -> FixedCurves:
    if path.exists():
        data = json.loads(path.read_text())
        curves = FixedCurves(**data)
        needed = {f"{r}|{key_of(t)}" for r in regimes for t in traces}
        if needed <= set(curves.hindsight):
            return curves
    curves = compute_curves(traces, regimes)
    path.write_text(json.dumps(curves.__dict__))
    return curves
