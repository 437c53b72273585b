"""Save as often as a stall budget allows: at most ``budget`` of wall time spent blocked."""

from __future__ import annotations

import math
from typing import Any

from pcframe.policies.base import (
    Decision,
    Event,
    PolicyContext,
    Restarted,
    SaveCompleted,
    SaveHint,
)
from pcframe.policies.periodic import SecondsIntervalPolicy
from pcframe.policies.registry import register


@register()
class OverheadBudget(SecondsIntervalPolicy):
    """Interval τ = C / budget, so that stall / wall time stays at ``budget``.

    The freshest checkpoint the budget can buy. A ledger of the stall actually spent (from
    ``SaveCompleted.stall``) against the wall time actually run guards the promise: while the
    job is over budget, e.g. because saves turned out slower than estimated, no save starts.

    Args:
        budget: allowed fraction of wall time stalled, e.g. 0.05 for 5 %.
        **kw: clamps and priors of :class:`~pcframe.policies.periodic.SecondsIntervalPolicy`.
    """

    name = "overhead_budget"

    def __init__(self, budget: float = 0.05, **kw: Any) -> None:
        if not 0.0 < budget < 1.0:
            raise ValueError(f"OverheadBudget: budget={budget} must be in (0, 1), e.g. 0.05")
        super().__init__(**kw)
        self.budget = budget
        self.stalled = 0.0  # seconds blocked by saves, summed over the job's life
        self.wall = 0.0  # seconds run, summed from decide-to-decide deltas (clock-agnostic)
        self._prev_now: float | None = None

    def target_interval(self, ctx: PolicyContext) -> float:
        return self.costs.save_stall(ctx) / self.budget

    def decide(self, ctx: PolicyContext) -> Decision:
        if self._prev_now is not None and ctx.now > self._prev_now:
            self.wall += ctx.now - self._prev_now
        self._prev_now = ctx.now
        if self.stalled > self.budget * self.wall:
            self.costs.track(ctx)  # keep measuring the iteration time while we hold back
            # ... and the interval: the hint is built from it, and a cost learned meanwhile
            # (a restored save's completion) moves it, as the next full decide would.
            self.last_interval = self.interval(ctx)
            return Decision(False)
        return super().decide(ctx)

    def save_hint(self, ctx: PolicyContext) -> SaveHint | None:
        hint = super().save_hint(ctx)
        if hint is None:
            return None
        # While over budget nothing starts until the wall time has caught up with the stall.
        behind = self.stalled / self.budget - self.wall
        if behind > 0 and hint.time is not None:
            hint = SaveHint(step=hint.step, time=max(hint.time, ctx.now + behind))
        return hint

    def observe(self, event: Event) -> None:
        super().observe(event)
        if isinstance(event, SaveCompleted) and math.isfinite(event.stall) and event.stall > 0:
            self.stalled += event.stall
        elif isinstance(event, Restarted):
            self._prev_now = None  # the next clock may be another process's

    def stall_fraction(self) -> float:
        """Stall spent so far as a fraction of wall time run."""
        return self.stalled / self.wall if self.wall > 0 else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "stalled": self.stalled,
            "wall": self.wall,
            "prev_now": self._prev_now,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.stalled = float(state.get("stalled", 0.0))
        self.wall = float(state.get("wall", 0.0))
        self._prev_now = state.get("prev_now")
