"""Shared machinery of policies that save every τ seconds of wall time, τ recomputed each step.

Subclasses only compute the target interval; this base owns the anchor (when the last save
was started), the clamps, the cost model and the state dict, so every such policy behaves the
same way at the edges: first step, restarts, clock jumps, missing measurements.
"""

from __future__ import annotations

import math
import numbers
from abc import abstractmethod
from typing import Any, Literal

from pcframe.errors import PolicyError
from pcframe.policies.base import (
    Decision,
    Event,
    IntervalPolicy,
    PolicyContext,
    Restarted,
    SaveHint,
)
from pcframe.policies.estimates import CostModel


class SecondsIntervalPolicy(IntervalPolicy):
    """Save when the wall time since the last save started reaches :meth:`interval`.

    Args:
        min_interval: never save more often than this (seconds).
        max_interval: never let more than this pass between saves (``None``: no bound).
            When it conflicts with the floor below, ``max_interval`` wins: it is the user's.
        concurrency: checkpoints the engine may have in flight. A new save cannot start
            sooner than time-to-durable / concurrency without piling up (PCcheck's rule), so
            that is a floor. ``"engine"`` (default): the engine's own ``max_in_flight``
            (``ctx.max_in_flight``; 1 where the caller does not say). ``None`` disables
            the floor.
        stall_prior, duration_prior, restart_prior, iteration_prior: seconds; used only
            until the engine has measured the real values.
        alpha: smoothing of the learned costs (weight of the newest sample).
    """

    def __init__(
        self,
        *,
        min_interval: float = 1.0,
        max_interval: float | None = None,
        concurrency: int | Literal["engine"] | None = "engine",
        stall_prior: float = 1.0,
        duration_prior: float = 10.0,
        restart_prior: float = 60.0,
        iteration_prior: float = 1.0,
        alpha: float = 0.25,
    ) -> None:
        if not (math.isfinite(min_interval) and min_interval >= 0):  # NaN passed `< 0`
            raise ValueError(f"min_interval={min_interval} must be >= 0 seconds")
        if max_interval is not None and not (max_interval > 0):  # NaN too; inf: no cap
            raise ValueError(f"max_interval={max_interval} must be > 0 seconds or None")
        if concurrency not in (None, "engine") and not (
            isinstance(concurrency, int) and not isinstance(concurrency, bool) and concurrency >= 1
        ):
            raise ValueError(f"concurrency={concurrency!r} must be >= 1, 'engine' or None")
        self.min_interval = float(min_interval)
        self.max_interval = None if max_interval is None else float(max_interval)
        self.concurrency = concurrency
        self.costs = CostModel(stall_prior, duration_prior, restart_prior, iteration_prior, alpha)
        self._anchor: float | None = None  # ctx.now when the last save was started
        self._last_step: int | None = None
        self.last_interval: float | None = None  # for inspection and logging

    @abstractmethod
    def target_interval(self, ctx: PolicyContext) -> float:
        """Seconds between checkpoint starts this policy wants, before clamps."""

    def interval(self, ctx: PolicyContext) -> float:
        """The target interval clamped to the floors and ceiling above."""
        tau = self.target_interval(ctx)
        # A float first: asked at every step, the numbers.Real check costs 20x a NaN test.
        if (type(tau) is not float and not _seconds(tau)) or tau != tau:
            # NaN said "never save" without a word (a plugin's 0/0): a job never saved
            raise PolicyError(
                f"policy {type(self).__module__}.{type(self).__qualname__}.target_interval "
                f"returned {tau!r:.80}; it must return seconds as a number (math.inf: no "
                "checkpoint wanted; values below the floors are raised to them)"
            )
        tau = float(tau)  # a Fraction (a numbers.Real) failed later, formatting the reason
        floor = self.min_interval
        if self.concurrency is not None:
            n = (ctx.max_in_flight or 1) if self.concurrency == "engine" else self.concurrency
            floor = max(floor, self.costs.save_duration(ctx) / n)
        tau = max(tau, floor)
        if self.max_interval is not None:
            tau = min(tau, self.max_interval)
        return tau

    def decide(self, ctx: PolicyContext) -> Decision:
        self.costs.track(ctx)
        if self._anchor is None or ctx.now < self._anchor:
            # First call (or the clock went back): the engine's last save if it is plausible,
            # else now; an empty job has nothing to lose yet.
            last = ctx.last_save_time
            self._anchor = last if last is not None and last <= ctx.now else ctx.now
        tau = self.interval(ctx)
        self.last_interval = tau
        if self._last_step is not None and ctx.step <= self._last_step:
            return Decision(False)
        elapsed = ctx.now - self._anchor
        if elapsed < tau:
            return Decision(False)
        self._anchor, self._last_step = ctx.now, ctx.step
        return Decision(True, f"{self.name}: {elapsed:.1f} s since last save >= {tau:.1f} s")

    def save_hint(self, ctx: PolicyContext) -> SaveHint | None:
        if self._anchor is None or self.last_interval is None:
            return None  # decide has not run yet
        after = ctx.step if self._last_step is None else max(ctx.step, self._last_step)
        return SaveHint(step=after + 1, time=self._anchor + self.last_interval)

    def observe(self, event: Event) -> None:
        self.costs.observe(event)
        if isinstance(event, Restarted):
            # A restore is as good as a fresh save: the interval starts again from here.
            self._anchor, self._last_step = event.time, event.step

    def state_dict(self) -> dict[str, Any]:
        return {
            "costs": self.costs.state_dict(),
            "anchor": self._anchor,
            "last_step": self._last_step,
            "last_interval": _finite_or_none(self.last_interval),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.costs.load_state_dict(state.get("costs", {}))
        self._anchor = state.get("anchor")
        self._last_step = state.get("last_step")
        self.last_interval = state.get("last_interval")


def _finite_or_none(x: float | None) -> float | None:
    """JSON has no infinity: store ``None`` instead (the engine writes strict JSON)."""
    return x if x is not None and math.isfinite(x) else None


def mtbf_from(ctx: PolicyContext, configured: float, use_context: bool) -> float:
    """The MTBF to plan with: the engine's predicted rate if given and wanted, else config."""
    rate = ctx.preemption_rate
    if use_context and rate is not None and math.isfinite(rate) and rate >= 0:
        return math.inf if rate == 0 else 1.0 / rate
    return configured


def _seconds(value: Any) -> bool:
    """Whether ``value`` is a number of seconds (numpy's included, never a bool)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)
