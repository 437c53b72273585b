"""Predictors of spot preemption rate and availability, each with its uncertainty.

A predictor learns from two feeds: history (traces, passed to its constructor or a
``from_traces`` factory) and the job's own life, reported through :meth:`Predictor.advance`
(the job ran on spot until ``now``), :meth:`Predictor.observe` (a preemption, a restart) and
:meth:`Predictor.observe_capacity` (how many of the requested spot VMs were up at ``now``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pcframe.errors import PolicyError
from pcframe.policies.base import Event, Stateful
from pcframe.policies.kinds import plugin_base
from pcframe.text import value_text


@dataclass(frozen=True)
class Estimate:
    """A point estimate with a two-sided interval holding the truth with ``confidence``."""

    value: float
    lower: float
    upper: float
    confidence: float = 0.9

    def __post_init__(self) -> None:
        if not (self.lower <= self.value <= self.upper):
            raise ValueError(f"Estimate needs lower <= value <= upper, got {self}")


@dataclass(frozen=True)
class Prediction:
    """What a predictor says at one instant.

    ``rate`` is in preemptions per second of spot up-time; ``availability`` is the expected
    fraction of requested spot capacity that is up (``None`` if the predictor cannot tell).
    """

    rate: Estimate
    availability: Estimate | None = None

    @property
    def mtbf(self) -> float:
        """Mean time between preemptions in seconds (``inf`` for a zero rate)."""
        return math.inf if self.rate.value <= 0.0 else 1.0 / self.rate.value


@plugin_base("predictor")
class Predictor(Stateful, ABC):
    """Predicts the preemption rate (and possibly availability) of spot capacity."""

    name: ClassVar[str] = ""

    @abstractmethod
    def predict(self, now: float | None = None) -> Prediction:
        """The prediction at ``now`` (unix seconds where a predictor uses the time of day)."""

    def advance(self, now: float) -> None:
        """The job has been running on spot up to ``now``: that time counts as exposure."""

    def observe(self, event: Event) -> None:
        """Learn from the job's own events (``Preempted`` counts one preemption)."""

    def observe_capacity(self, now: float, up: int, capacity: int) -> None:
        """``up`` of ``capacity`` requested spot VMs were running at ``now``."""


def gamma_quantile(q: float, shape: float, rate: float) -> float:
    """``q``-quantile of Gamma(shape, rate): ``scipy.stats.gamma.ppf(q, shape, scale=1/rate)``.

    Calls the special function scipy.stats itself uses, without its ~100 µs of argument
    handling per call: predictors run inside the trace simulator thousands of times.
    """
    from scipy.special import gammaincinv  # lazy, like scipy.stats

    return float(gammaincinv(shape, q)) * (1.0 / rate)


def beta_quantile(q: float, a: float, b: float) -> float:
    """``q``-quantile of Beta(a, b): ``scipy.stats.beta.ppf(q, a, b)``, fast (see above)."""
    from scipy.special import betaincinv

    return float(betaincinv(a, b, q))


def poisson_interval(count: float, exposure: float, confidence: float) -> tuple[float, float]:
    """Exact (Garwood) interval for a Poisson rate from ``count`` events in ``exposure`` s."""
    if exposure <= 0.0:
        return 0.0, math.inf
    from scipy.special import gammaincinv

    # chi2.ppf(p, 2k) / 2 = gammaincinv(k, p): the Garwood bounds without scipy.stats.
    alpha = 1.0 - confidence
    lo = 0.0 if count <= 0 else float(gammaincinv(count, alpha / 2.0)) / exposure
    hi = float(gammaincinv(count + 1.0, 1.0 - alpha / 2.0)) / exposure
    return lo, hi


def clamp_estimate(value: float, lower: float, upper: float, confidence: float) -> Estimate:
    """An Estimate whose interval is widened, if numerics require, to contain the value."""
    return Estimate(value, min(lower, value), max(upper, value), confidence)


def check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be strictly between 0 and 1, e.g. 0.9")


def checked_prediction(predictor: Any, prediction: Any) -> Prediction:
    """``prediction`` if it keeps the contract (:class:`PredictorConformance` states it): a
    :class:`Prediction` whose rate is an :class:`Estimate` >= 0 and whose availability, if
    any, an :class:`Estimate` within [0, 1]. Else a :class:`PolicyError` naming the
    predictor's class on one line (``None`` or a bare number failed deep in
    PreemptionAware or the simulator; a negative rate read as no preemption at all)."""
    problem = None
    if not isinstance(prediction, Prediction):
        problem = "not a Prediction"
    elif not isinstance(prediction.rate, Estimate) or not prediction.rate.lower >= 0:
        problem = "its rate must be an Estimate of preemptions per second >= 0"
    elif prediction.availability is not None and not (
        isinstance(prediction.availability, Estimate)
        and prediction.availability.lower >= 0
        and prediction.availability.upper <= 1
    ):
        problem = "its availability must be None or an Estimate within [0, 1]"
    if problem is None:
        return prediction
    who = f"{type(predictor).__module__}.{type(predictor).__qualname__}"
    raise PolicyError(
        f"predictor {who}.predict returned {value_text(prediction, 120)}: {problem}. Fix: "
        "return pcframe.policies.Prediction(rate=Estimate(value, lower, upper), "
        "availability=None or an Estimate)"
    )
