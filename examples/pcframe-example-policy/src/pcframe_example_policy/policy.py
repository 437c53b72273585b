"""Save every ``steps`` steps or every ``seconds`` seconds, whichever comes first."""

from __future__ import annotations

from typing import Any

from pcframe.policies import Decision, Event, IntervalPolicy, PolicyContext, Restarted


class StepsOrSeconds(IntervalPolicy):
    """Constructor arguments are the config; everything learned goes into the state dict."""

    name = "steps_or_seconds"

    def __init__(self, steps: int = 500, seconds: float = 900.0) -> None:
        if steps < 1 or seconds <= 0:
            raise ValueError(f"need steps >= 1 and seconds > 0, got {steps}, {seconds}")
        self.steps = steps
        self.seconds = seconds
        self._step: int | None = None  # step and time of the last save this policy asked for
        self._time: float | None = None

    def decide(self, ctx: PolicyContext) -> Decision:
        if self._step is None or self._time is None or ctx.now < self._time:
            self._step, self._time = ctx.step, ctx.now  # first call, or a new clock
            return Decision(False)
        if ctx.step - self._step >= self.steps or ctx.now - self._time >= self.seconds:
            self._step, self._time = ctx.step, ctx.now
            return Decision(True, "steps or seconds reached")
        return Decision(False)

    def observe(self, event: Event) -> None:
        if isinstance(event, Restarted):
            self._step, self._time = event.step, None  # a restore counts as a save

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "time": self._time}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = state.get("step")
        self._time = state.get("time")
