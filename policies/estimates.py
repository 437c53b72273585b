"""Online estimates of what checkpoints cost, learned from the engine's measurements.

Config values are only priors: once the policy has seen a sample it trusts the sample. The
precedence is *own samples* (events passed to ``observe``, smoothed, surviving restarts in the
state dict) > the engine's value in :class:`~pcframe.policies.base.PolicyContext` > the prior.
"""

from __future__ import annotations

import math
from typing import Any

from pcframe.policies.base import Event, PolicyContext, Restarted, SaveCompleted, Stateful


def _valid(x: float | None) -> bool:
    return x is not None and isinstance(x, int | float) and math.isfinite(x) and x >= 0.0


class RunningEstimate(Stateful):
    """Exponentially weighted mean and mean absolute deviation of a non-negative quantity.

    The first sample replaces the prior outright (a prior is a guess, a sample is a fact);
    later samples move the mean by ``alpha`` so one outlier cannot swing a policy.
    """

    def __init__(self, prior: float, alpha: float = 0.25) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        if not _valid(prior):
            raise ValueError(f"prior={prior!r} must be a finite number >= 0")
        self.prior = float(prior)
        self.alpha = alpha
        self.mean = float(prior)
        self.dev = 0.0
        self.count = 0

    def update(self, x: float | None) -> None:
        """Add one sample; ``None``, NaN and negative values are ignored, never raised on."""
        if not _valid(x):
            return
        x = float(x)  # type: ignore[arg-type]
        if self.count == 0:
            self.mean, self.dev = x, 0.0
        else:
            self.dev += self.alpha * (abs(x - self.mean) - self.dev)
            self.mean += self.alpha * (x - self.mean)
        self.count += 1

    def value(self, fallback: float | None = None) -> float:
        """Own mean if any sample was seen, else ``fallback`` (the engine's value), else prior."""
        if self.count:
            return self.mean
        return float(fallback) if _valid(fallback) else self.prior  # type: ignore[arg-type]

    def upper(self, z: float = 2.0, fallback: float | None = None) -> float:
        """A pessimistic value (mean + z·deviation): for decisions where too low is costly."""
        return self.value(fallback) + (z * self.dev if self.count else 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "dev": self.dev, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean = float(state.get("mean", self.prior))
        self.dev = float(state.get("dev", 0.0))
        self.count = int(state.get("count", 0))


class CostModel(Stateful):
    """Learned stall, time to durable, restart cost and iteration time of one job."""

    def __init__(
        self,
        stall_prior: float = 1.0,
        duration_prior: float = 10.0,
        restart_prior: float = 60.0,
        iteration_prior: float = 1.0,
        alpha: float = 0.25,
    ) -> None:
        self.stall = RunningEstimate(stall_prior, alpha)
        self.duration = RunningEstimate(duration_prior, alpha)
        self.restart = RunningEstimate(restart_prior, alpha)
        self.iteration = RunningEstimate(iteration_prior, alpha)
        # (step, now) of the previous decide call: iteration time measured by the policy itself
        # when the engine does not fill ``ctx.iteration_time``. Persisted so that a restored
        # policy acts exactly like the original; ``Restarted`` clears it, since the clocks of
        # two processes need not agree.
        self._prev: tuple[int, float] | None = None

    def observe(self, event: Event) -> None:
        if isinstance(event, SaveCompleted):
            self.stall.update(event.stall)
            self.duration.update(event.duration)
        elif isinstance(event, Restarted):
            self.restart.update(event.restart_cost)
            self._prev = None

    def track(self, ctx: PolicyContext) -> None:
        """Call once per ``decide``: measures the iteration time from successive contexts."""
        if ctx.iteration_time is None and self._prev is not None:
            step0, now0 = self._prev
            if ctx.step > step0 and ctx.now > now0:
                self.iteration.update((ctx.now - now0) / (ctx.step - step0))
        self._prev = (ctx.step, ctx.now)

    def save_stall(self, ctx: PolicyContext) -> float:
        return self.stall.value(ctx.save_stall)

    def save_duration(self, ctx: PolicyContext) -> float:
        return self.duration.value(ctx.save_duration)

    def restart_cost(self, ctx: PolicyContext) -> float:
        return self.restart.value(ctx.restart_cost)

    def iteration_time(self, ctx: PolicyContext) -> float:
        # The engine's measurement of the current iteration time beats our own smoothing.
        if _valid(ctx.iteration_time) and ctx.iteration_time > 0:  # type: ignore[operator]
            return float(ctx.iteration_time)  # type: ignore[arg-type]
        return self.iteration.value()

    def state_dict(self) -> dict[str, Any]:
        return {
            "stall": self.stall.state_dict(),
            "duration": self.duration.state_dict(),
            "restart": self.restart.state_dict(),
            "iteration": self.iteration.state_dict(),
            "prev": None if self._prev is None else list(self._prev),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("stall", "duration", "restart", "iteration"):
            if key in state:
                getattr(self, key).load_state_dict(state[key])
        prev = state.get("prev")
        self._prev = None if prev is None else (int(prev[0]), float(prev[1]))
