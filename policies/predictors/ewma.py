"""Exponentially weighted rate: recent preemptions count more, old ones fade with a half-life."""

from __future__ import annotations

import math
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
class EwmaRate(Predictor):
    """Discounted maximum likelihood: rate = Σ w·events / Σ w·exposure, w = 2^(−age/half-life).

    The interval is the exact Poisson interval at the discounted (effective) count and
    exposure, so it widens again when the evidence ages. Availability is an EWMA of the
    capacity samples with the same half-life.

    Args:
        halflife: seconds after which an observation weighs half.
        prior_mtbf: answer before any exposure was seen.
        confidence: coverage of the intervals.
    """

    name = "ewma"

    def __init__(
        self, halflife: float = 3 * 3600.0, prior_mtbf: float = 3600.0, confidence: float = 0.9
    ) -> None:
        if not halflife > 0:  # NaN too: every prediction was NaN
            raise ValueError(f"halflife={halflife} must be > 0 seconds")
        if not (math.isfinite(prior_mtbf) and prior_mtbf > 0):  # NaN passed `<= 0`
            raise ValueError(f"prior_mtbf={prior_mtbf} must be > 0 seconds")
        check_confidence(confidence)
        self.halflife = float(halflife)
        self.prior_mtbf = float(prior_mtbf)
        self.confidence = confidence
        self._clock = ExposureClock()
        self._count = 0.0
        self._exposure = 0.0
        self._t: float | None = None  # time the discounted sums refer to
        self._avail = 0.0
        self._avail_sq = 0.0
        self._avail_w = 0.0

    def _decay_to(self, now: float) -> None:
        if self._t is not None and now > self._t:
            k = math.exp(-(now - self._t) * math.log(2.0) / self.halflife)
            self._count *= k
            self._exposure *= k
            self._avail_w *= k
        if self._t is None or now > self._t:
            self._t = now

    def advance(self, now: float) -> None:
        dt = self._clock.advance(now)
        self._decay_to(now)
        self._exposure += dt

    def observe(self, event: Event) -> None:
        dt, n = self._clock.observe(event)
        if dt or n:
            self._decay_to(event.time)
            self._exposure += dt
            self._count += n

    def observe_capacity(self, now: float, up: int, capacity: int) -> None:
        if capacity <= 0:
            return
        x = min(max(up / capacity, 0.0), 1.0)
        self._decay_to(now)
        # Weighted running mean and second moment with weights that decay like the counts.
        self._avail_w += 1.0
        a = 1.0 / self._avail_w
        self._avail += a * (x - self._avail)
        self._avail_sq += a * (x * x - self._avail_sq)

    def predict(self, now: float | None = None) -> Prediction:
        if now is not None:
            self._decay_to(now)
        if self._exposure <= 0.0:
            rate = Estimate(1.0 / self.prior_mtbf, 0.0, math.inf, self.confidence)
        else:
            lo, hi = poisson_interval(self._count, self._exposure, self.confidence)
            rate = clamp_estimate(self._count / self._exposure, lo, hi, self.confidence)
        avail = None
        if self._avail_w > 0.0:
            var = max(self._avail_sq - self._avail**2, 0.0)
            z = NormalDist().inv_cdf(0.5 + self.confidence / 2.0)
            half = z * math.sqrt(var / max(self._avail_w, 1.0))
            m = min(max(self._avail, 0.0), 1.0)
            avail = Estimate(m, max(0.0, m - half), min(1.0, m + half), self.confidence)
        return Prediction(rate, avail)

    def state_dict(self) -> dict[str, Any]:
        return {
            "clock": self._clock.state_dict(),
            "count": self._count,
            "exposure": self._exposure,
            "t": self._t,
            "avail": [self._avail, self._avail_sq, self._avail_w],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._clock.load_state_dict(state.get("clock", {}))
        self._count = float(state.get("count", 0.0))
        self._exposure = float(state.get("exposure", 0.0))
        t = state.get("t")
        self._t = None if t is None else float(t)
        self._avail, self._avail_sq, self._avail_w = (
            float(x) for x in state.get("avail", [0.0, 0.0, 0.0])
        )
