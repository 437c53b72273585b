"""CheckFreq-style adaptive frequency (FAST '21), re-profiled online instead of once.

k = max(⌈(t_full − stall) / t_iter⌉, 1) iterations lets one asynchronous checkpoint finish
before the next starts; then k grows by 2 while the stall per interval exceeds the overhead
budget. CheckFreq profiles once at the start; here every completed save refines the
estimates and k follows them, up or down, so a change of checkpoint cost is tracked.
"""

from __future__ import annotations

import math
from typing import Any

from pcframe.policies.base import (
    Decision,
    Event,
    IntervalPolicy,
    PolicyContext,
    Restarted,
    SaveCompleted,
    SaveHint,
)
from pcframe.policies.estimates import CostModel
from pcframe.policies.registry import register


def checkfreq_k(t_iter: float, stall: float, duration: float, budget: float) -> int:
    """Iterations between checkpoints for the given costs (CheckFreq's rule)."""
    if t_iter <= 0:
        raise ValueError(f"iteration time {t_iter} must be > 0")
    k = max(math.ceil((duration - stall) / t_iter), 1)
    # The "add 2 while over budget" loop of CheckFreq in closed form: the smallest k + 2j
    # with stall / (k·t_iter) <= budget.
    need = stall / (budget * t_iter)
    if k < need:
        k += 2 * math.ceil((need - k) / 2.0 - 1e-12)
    return k


@register()
class CheckFreq(IntervalPolicy):
    """Checkpoint every k steps, k re-derived from measured iteration and checkpoint costs.

    Args:
        budget: allowed stall per interval as a fraction of its compute time (CheckFreq: 5 %).
        max_k: upper clamp on k (``None``: none).
        stall_prior, duration_prior, iteration_prior: seconds, used until measured.
        alpha: smoothing of the learned costs.
    """

    name = "checkfreq"

    def __init__(
        self,
        budget: float = 0.05,
        max_k: int | None = None,
        stall_prior: float = 1.0,
        duration_prior: float = 10.0,
        iteration_prior: float = 1.0,
        alpha: float = 0.3,
    ) -> None:
        if not 0.0 < budget < 1.0:
            raise ValueError(f"CheckFreq: budget={budget} must be in (0, 1), e.g. 0.05")
        if max_k is not None and max_k < 1:
            raise ValueError(f"CheckFreq: max_k={max_k} must be >= 1 or None")
        if not iteration_prior > 0:  # k divides by it: 0 failed at the first decide
            raise ValueError(f"CheckFreq: iteration_prior={iteration_prior} must be > 0 seconds")
        self.budget = budget
        self.max_k = max_k
        self.costs = CostModel(stall_prior, duration_prior, 60.0, iteration_prior, alpha)
        self.k: int | None = None
        self._last_step: int | None = None
        self._stale = True  # recompute k at the next decide

    def _update_k(self, ctx: PolicyContext) -> int:
        k = checkfreq_k(
            self.costs.iteration_time(ctx),
            self.costs.save_stall(ctx),
            self.costs.save_duration(ctx),
            self.budget,
        )
        return min(k, self.max_k) if self.max_k is not None else k

    def decide(self, ctx: PolicyContext) -> Decision:
        self.costs.track(ctx)
        if self._stale or self.k is None:
            self.k = self._update_k(ctx)
            self._stale = self.costs.stall.count == 0  # keep following ctx until own samples
        if self._last_step is None:
            self._last_step = ctx.last_save_step if ctx.last_save_step is not None else ctx.step
        if ctx.step - self._last_step < self.k:
            return Decision(False)
        self._last_step = ctx.step
        return Decision(True, f"checkfreq: {self.k} steps since the last save")

    def save_hint(self, ctx: PolicyContext) -> SaveHint | None:
        if self.k is None or self._last_step is None:
            return None
        # k may change after the next SaveCompleted; the caller decides again after events.
        return SaveHint(step=max(self._last_step + self.k, ctx.step + 1))

    def observe(self, event: Event) -> None:
        self.costs.observe(event)
        if isinstance(event, SaveCompleted):
            self._stale = True
        elif isinstance(event, Restarted):
            self._last_step = event.step

    def state_dict(self) -> dict[str, Any]:
        return {
            "costs": self.costs.state_dict(),
            "k": self.k,
            "last_step": self._last_step,
            "stale": self._stale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.costs.load_state_dict(state.get("costs", {}))
        self.k = state.get("k")
        self._last_step = state.get("last_step")
        self._stale = bool(state.get("stale", True))
