"""Preemption hazard by hour of day (UTC) and zone, from historical traces.

Spot capacity follows the daily load of a region, so the rate at 14:00 can differ from the
rate at 03:00 several-fold. Each hour bin is shrunk towards the pooled rate of all hours
(a Gamma prior worth ``prior_strength`` seconds) so thinly observed bins stay sane.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np

from pcframe.policies.base import Event
from pcframe.policies.predictors.base import (
    Estimate,
    Prediction,
    Predictor,
    check_confidence,
    clamp_estimate,
    gamma_quantile,
)
from pcframe.policies.predictors.exposure import ExposureClock
from pcframe.policies.predictors.history import TraceSource, resolve_traces
from pcframe.policies.registry import register

DAY = 86400.0


@register()
class HazardByTimeOfDay(Predictor):
    """Rate and availability per time-of-day bin, fitted on traces that carry a start time.

    Args:
        traces: list of :class:`~pcframe.policies.traces.Trace`, a trace file or folder
            (``None``: the shipped traces). Only traces with a start time are used.
        zone: restrict to traces of this zone (``None``: pool every zone given).
        bins: bins per day (24 = hourly).
        prior_strength: seconds of pooled evidence each bin is shrunk towards.
        confidence: coverage of the reported intervals.
        own_weight: how much one second of the job's own exposure counts vs. history.

    ``predict(now)`` needs ``now`` in unix seconds; without it the pooled rate is returned.
    """

    name = "hazard_tod"

    def __init__(
        self,
        traces: TraceSource = None,
        zone: str | None = None,
        bins: int = 24,
        prior_strength: float = 6 * 3600.0,
        confidence: float = 0.9,
        own_weight: float = 1.0,
    ) -> None:
        if bins < 1 or DAY % bins:
            raise ValueError(f"bins={bins} must divide a day evenly (e.g. 24, 48, 96)")
        if prior_strength <= 0 or own_weight < 0:
            raise ValueError("prior_strength must be > 0 and own_weight >= 0")
        check_confidence(confidence)
        self.zone = zone
        self.bins = bins
        self.prior_strength = float(prior_strength)
        self.confidence = confidence
        self.own_weight = float(own_weight)
        found = [t for t in resolve_traces(traces, zone) if t.start_time is not None]
        if not found:
            raise ValueError(
                "no trace with a start time: time-of-day needs timestamps (SkyNomad "
                "availability CSVs, GCP H100 JSON, PCcheck, or pcframe traces with start_time)"
            )
        self.counts = np.zeros(bins)
        self.exposure = np.zeros(bins)
        self.up = np.zeros(bins)
        self.ticks = np.zeros(bins)
        self.bin_days = np.zeros(bins)  # how many distinct bin-periods were observed
        for t in found:
            b = self._bin_of(t.unix_times())
            up = t.up > 0
            np.add.at(self.counts, b, (t.drops() > 0).astype(float))
            np.add.at(self.exposure, b, up * t.step_seconds)
            np.add.at(self.up, b, t.up / t.capacity)
            np.add.at(self.ticks, b, 1.0)
            np.add.at(self.bin_days, b, t.step_seconds / (DAY / bins))
        self.sources = sorted({t.name for t in found})
        self._clock = ExposureClock()

    def _bin_of(self, unix: Any) -> Any:
        """Bin index of unix time(s): vectorised for arrays, plain floats for one instant
        (called every step, where numpy's per-call overhead would dominate)."""
        if isinstance(unix, float | int):
            return int((unix % DAY) // (DAY / self.bins)) % self.bins
        return (np.floor(np.mod(unix, DAY) / (DAY / self.bins))).astype(int) % self.bins

    def advance(self, now: float) -> None:
        dt = self._clock.advance(now)
        if dt > 0:
            self.exposure[int(self._bin_of(now))] += dt * self.own_weight

    def observe(self, event: Event) -> None:
        dt, n = self._clock.observe(event)
        if dt or n:
            b = int(self._bin_of(event.time))
            self.exposure[b] += dt * self.own_weight
            self.counts[b] += n * self.own_weight

    def observe_capacity(self, now: float, up: int, capacity: int) -> None:
        if capacity > 0:
            b = int(self._bin_of(now))
            self.up[b] += min(max(up / capacity, 0.0), 1.0) * self.own_weight
            self.ticks[b] += self.own_weight

    def rate_by_bin(self) -> np.ndarray:
        """Shrunk rate of every bin, preemptions per second."""
        pooled = self.counts.sum() / max(self.exposure.sum(), 1e-9)
        return (self.counts + self.prior_strength * pooled) / (self.exposure + self.prior_strength)

    def predict(self, now: float | None = None) -> Prediction:
        pooled = self.counts.sum() / max(self.exposure.sum(), 1e-9)
        if now is None:
            a, b = self.counts.sum(), self.exposure.sum()
            up, ticks, days = self.up.sum(), self.ticks.sum(), self.bin_days.sum()
        else:
            i = int(self._bin_of(now))
            a = self.counts[i] + self.prior_strength * pooled
            b = self.exposure[i] + self.prior_strength
            up, ticks, days = self.up[i], self.ticks[i], self.bin_days[i]
        tail = (1.0 - self.confidence) / 2.0
        if a <= 0:
            rate = Estimate(0.0, 0.0, float(-math.log(tail) / max(b, 1e-9)), self.confidence)
        else:
            rate = clamp_estimate(
                a / b,
                gamma_quantile(tail, a, b),
                gamma_quantile(1.0 - tail, a, b),
                self.confidence,
            )
        avail = None
        if ticks > 0:
            m = min(max(up / ticks, 0.0), 1.0)
            # Ticks within one bin of one day are nearly the same sample: count bin-days.
            z = NormalDist().inv_cdf(0.5 + self.confidence / 2.0)
            half = z * math.sqrt(m * (1.0 - m) / max(days, 1.0))
            avail = Estimate(m, max(0.0, m - half), min(1.0, m + half), self.confidence)
        return Prediction(rate, avail)

    def state_dict(self) -> dict[str, Any]:
        return {
            "counts": self.counts.tolist(),
            "exposure": self.exposure.tolist(),
            "up": self.up.tolist(),
            "ticks": self.ticks.tolist(),
            "bin_days": self.bin_days.tolist(),
            "clock": self._clock.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("counts", "exposure", "up", "ticks", "bin_days"):
            if key in state:
                values = np.asarray(state[key], dtype=float)
                if values.shape != (self.bins,):
                    raise ValueError(
                        f"HazardByTimeOfDay state {key!r} has {values.size} bins, "
                        f"this predictor has {self.bins}; use the same bins setting"
                    )
                setattr(self, key, values)
        self._clock.load_state_dict(state.get("clock", {}))
