"""Windowed Poisson rate: maximum-likelihood count/exposure over the last ``window`` seconds."""

from __future__ import annotations

import math
from collections import deque
from statistics import NormalDist
from typing import Any

from pcframe.policies.base import Event
from pcframe.policies.predictors.base import (
    Estimate,
    Prediction,
    Predictor,
    check_confidence,
    clamp_estimate,
    poisson_interval,
)
from pcframe.policies.predictors.exposure import ExposureClock
from pcframe.policies.registry import register


@register()
class WindowedPoisson(Predictor):
    """Rate = preemptions / exposure inside a sliding window, with an exact Poisson interval.

    Args:
        window: seconds of history that count; older exposure and events are forgotten.
        confidence: coverage of the reported interval (Garwood's exact interval).
        prior_mtbf: what to answer before any exposure was seen (interval then ``[0, inf]``).
    """

    name = "poisson_window"

    def __init__(
        self, window: float = 6 * 3600.0, confidence: float = 0.9, prior_mtbf: float = 3600.0
    ) -> None:
        if not window > 0:  # NaN too
            raise ValueError(f"window={window} must be > 0 seconds")
        if not (math.isfinite(prior_mtbf) and prior_mtbf > 0):  # NaN passed `<= 0`
            raise ValueError(f"prior_mtbf={prior_mtbf} must be > 0 seconds")
        check_confidence(confidence)
        self.window = float(window)
        self.confidence = confidence
        self.prior_mtbf = float(prior_mtbf)
        self._clock = ExposureClock()
        # (end time, seconds) exposure pieces and preemption times, oldest first.
        self._exposure: deque[tuple[float, float]] = deque()
        self._events: deque[float] = deque()
        self._capacity: deque[tuple[float, float]] = deque()
        self._now: float | None = None

    # --- feeds -------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        self._add(now, self._clock.advance(now), 0)

    def observe(self, event: Event) -> None:
        dt, n = self._clock.observe(event)
        if dt or n:
            self._add(event.time, dt, n)

    def observe_capacity(self, now: float, up: int, capacity: int) -> None:
        if capacity > 0:
            self._capacity.append((now, min(max(up / capacity, 0.0), 1.0)))
            self._touch(now)

    def _add(self, t: float, dt: float, n: int) -> None:
        if dt > 0:
            self._exposure.append((t, dt))
        self._events.extend([t] * n)
        self._touch(t)

    def _touch(self, now: float) -> None:
        self._now = now if self._now is None else max(self._now, now)
        cut = self._now - self.window
        for queue in (self._exposure, self._capacity):
            while queue and queue[0][0] < cut:
                queue.popleft()
        while self._events and self._events[0] < cut:
            self._events.popleft()

    # --- answer ------------------------------------------------------------------------------
    def predict(self, now: float | None = None) -> Prediction:
        if now is not None:
            self._touch(now)
        exposure = sum(dt for _, dt in self._exposure)
        n = len(self._events)
        if exposure <= 0.0:
            rate = Estimate(1.0 / self.prior_mtbf, 0.0, math.inf, self.confidence)
        else:
            lo, hi = poisson_interval(n, exposure, self.confidence)
            rate = clamp_estimate(n / exposure, lo, hi, self.confidence)
        return Prediction(rate, self._availability())

    def _availability(self) -> Estimate | None:
        if not self._capacity:
            return None
        xs = [x for _, x in self._capacity]
        mean = sum(xs) / len(xs)
        # Normal interval on the window mean; samples are autocorrelated, so this is optimistic.
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / max(len(xs) - 1, 1))
        half = NormalDist().inv_cdf(0.5 + self.confidence / 2.0) * sd / math.sqrt(len(xs))
        return Estimate(mean, max(0.0, mean - half), min(1.0, mean + half), self.confidence)

    def state_dict(self) -> dict[str, Any]:
        return {
            "clock": self._clock.state_dict(),
            "exposure": [list(x) for x in self._exposure],
            "events": list(self._events),
            "capacity": [list(x) for x in self._capacity],
            "now": self._now,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._clock.load_state_dict(state.get("clock", {}))
        self._exposure = deque((float(t), float(d)) for t, d in state.get("exposure", []))
        self._events = deque(float(t) for t in state.get("events", []))
        self._capacity = deque((float(t), float(x)) for t, x in state.get("capacity", []))
        now = state.get("now")
        self._now = None if now is None else float(now)
