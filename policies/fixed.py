"""Checkpoint every ``every`` steps: the baseline every other policy is measured against."""

from __future__ import annotations

import numbers
from typing import Any

from pcframe.policies.base import Decision, IntervalPolicy, PolicyContext, SaveHint
from pcframe.policies.registry import register


@register()
class FixedSteps(IntervalPolicy):
    name = "fixed_steps"

    def __init__(self, every: int = 10) -> None:
        # A float or a bool would pass as a number of steps: 2.5 saves every 5 steps, True
        # every step.
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(f"FixedSteps: every={every!r} must be a whole number of steps >= 1")
        self.every = int(every)

    def decide(self, ctx: PolicyContext) -> Decision:
        if ctx.step > 0 and ctx.step % self.every == 0:
            return Decision(True, f"step {ctx.step} is a multiple of {self.every}")
        return Decision(False)

    def save_hint(self, ctx: PolicyContext) -> SaveHint:
        # Stateless and periodic: the simulator may skip every step in between.
        return SaveHint(step=(max(ctx.step, 0) // self.every + 1) * self.every, every=self.every)

    def state_dict(self) -> dict[str, Any]:
        return {"every": self.every}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The configured interval wins over a saved one: config is the user's latest word.
        del state
