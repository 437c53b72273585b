"""Yardsticks no real policy can use: the oracle and the best fixed interval in hindsight."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from pcframe.policies.base import Decision, IntervalPolicy, PolicyContext, SaveHint
from pcframe.policies.fixed import FixedSteps
from pcframe.sim.result import SimResult
from pcframe.sim.spec import JobSpec


class Oracle(IntervalPolicy):
    """Knows when the process will be preempted and checkpoints just in time: an upper bound.

    It saves once per process, at the last step boundary from which a save is still durable
    before the preemption (start + time to durable <= preemption), so it loses at most one
    step plus the time to durable per preemption and pays one stall, which falls after the
    saved step and so costs nothing that survives. Nothing else it could do keeps more work:
    a durable save must start at least ``save_duration`` before the kill, and with no
    preemption ahead any save only costs stall. The simulator tells it the future through
    :meth:`foresee` at every process start; it cannot run in a real engine.
    """

    name = "oracle"

    def __init__(self) -> None:
        self._kill = math.inf
        self._duration = 0.0
        self._it = 1.0
        self._emergency = False
        self._saved_for: float | None = None

    def foresee(self, kill_at: float, job: JobSpec, step_time: float) -> None:
        """Called by the simulator when a process starts: when it will die, and its costs."""
        self._kill = kill_at
        self._duration = job.save_duration
        # With a faster tier that survives the VM, the last save goes there (as an emergency
        # save would): later, so it keeps more work. No notice-driven policy can do better.
        self._emergency = False
        fast = job.survivor_tier_duration
        if fast is not None and fast < job.save_duration:
            self._duration, self._emergency = fast, True
        self._it = step_time
        self._saved_for = None

    def decide(self, ctx: PolicyContext) -> Decision:
        if math.isinf(self._kill) or self._saved_for == self._kill:
            return Decision(False)
        latest = self._kill - self._duration  # a save started after this is not durable
        if ctx.now > latest:
            return Decision(False)
        if ctx.now + self._it <= latest:  # the next step boundary is still in time
            return Decision(False)
        if ctx.last_save_step is not None and ctx.last_save_step >= ctx.step:
            return Decision(False)
        self._saved_for = self._kill
        reason = f"oracle: preemption in {self._kill - ctx.now:.1f} s"
        return Decision(True, reason, emergency=self._emergency)

    def save_hint(self, ctx: PolicyContext) -> SaveHint:
        if math.isinf(self._kill) or self._saved_for == self._kill:
            return SaveHint(time=math.inf)
        return SaveHint(step=ctx.step + 1, time=self._kill - self._duration - self._it)


def fixed_interval_grid(job: JobSpec, horizon: float, points: int = 40) -> list[int]:
    """Geometric grid of intervals in steps, from 1 to a step count spanning ``horizon`` s."""
    top = max(2, int(horizon / job.iteration_time))
    grid = np.unique(np.round(np.geomspace(1, top, points)).astype(int))
    return [int(x) for x in grid if x >= 1]


def best_fixed_interval(
    run: Callable[[IntervalPolicy], SimResult],
    job: JobSpec,
    horizon: float,
    points: int = 48,
    refine: int = 12,
) -> tuple[int, SimResult, list[tuple[int, float]]]:
    """The ``FixedSteps`` interval with the highest goodput on this trace, found in hindsight.

    ``run(policy)`` simulates one policy (same trace, job and options). A geometric grid is
    searched, then a finer one between the best point's neighbours. Returns the interval,
    its result and every (interval, goodput) tried.
    """
    tried: dict[int, SimResult] = {}

    def evaluate(every: int) -> None:
        if every not in tried:
            tried[every] = run(FixedSteps(every))

    grid = fixed_interval_grid(job, horizon, points)
    for every in grid:
        evaluate(every)
    best = max(tried, key=lambda e: tried[e].goodput)
    i = grid.index(best)
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    for every in np.unique(np.round(np.geomspace(lo, hi, refine)).astype(int)):
        evaluate(int(every))
    best = max(tried, key=lambda e: (tried[e].goodput, -e))
    curve = sorted((e, r.goodput) for e, r in tried.items())
    return best, tried[best], curve


__all__: Sequence[str] = ["Oracle", "best_fixed_interval", "fixed_interval_grid"]
