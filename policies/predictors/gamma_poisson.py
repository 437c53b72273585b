"""Online Bayesian rate: Gamma prior (from history or config) updated with the job's own life."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pcframe.policies.base import Event
from pcframe.policies.predictors.base import (
    Estimate,
    Prediction,
    Predictor,
    beta_quantile,
    check_confidence,
    clamp_estimate,
    gamma_quantile,
)
from pcframe.policies.predictors.exposure import ExposureClock
from pcframe.policies.predictors.history import (
    TraceSource,
    pooled_availability,
    pooled_rate,
    resolve_traces,
)
from pcframe.policies.predictors.lifetime import (
    LifeShapePosterior,
    rate_mixture,
    rate_prior,
    shape_prior,
)
from pcframe.policies.registry import register


@register()
class GammaPoissonRate(Predictor):
    """Preemptions are Poisson with an unknown rate λ ~ Gamma(α, β) (α events in β seconds).

    Each preemption adds 1 to α, each second of exposure adds 1 to β; the reported interval is
    the equal-tailed posterior interval. ``prior_strength`` says how many seconds of history
    the prior is worth: small lets the job's own preemptions dominate quickly. With
    ``forget_halflife`` the evidence decays (the regime of a zone changes over days).
    Availability uses a Beta posterior over capacity samples in the same way.

    ``prior_components`` (``(α_i, β_i)`` pairs, equal weights) makes the prior a mixture of
    Gammas instead: the same counts update every component, and each is weighted by how
    well it predicted them (its negative-binomial marginal likelihood), so the evidence
    picks the kind of zone this is (docs/policies.md, "How PA learns").
    """

    name = "gamma_poisson"

    def __init__(
        self,
        prior_mtbf: float = 3600.0,
        prior_strength: float = 6 * 3600.0,
        confidence: float = 0.9,
        forget_halflife: float | None = None,
        prior_availability: float | None = None,
        availability_strength: float = 10.0,
        life_prior: Sequence[float] | None = None,
        prior_components: Sequence[Sequence[float]] | None = None,
    ) -> None:
        if not (math.isfinite(prior_mtbf) and prior_mtbf > 0 and prior_strength > 0):
            raise ValueError(
                f"prior_mtbf={prior_mtbf} and prior_strength={prior_strength} must be > 0 s"
            )
        if forget_halflife is not None and not forget_halflife > 0:  # NaN too
            raise ValueError(f"forget_halflife={forget_halflife} must be > 0 seconds or None")
        if not availability_strength > 0:  # its Beta prior's weight: NaN or < 0 gave NaN
            raise ValueError(f"availability_strength={availability_strength} must be > 0")
        if prior_availability is not None and not 0.0 <= prior_availability <= 1.0:
            raise ValueError(f"prior_availability={prior_availability} must be in [0, 1]")
        check_confidence(confidence)
        self.prior_components = None
        if prior_components is not None:
            comps = np.array([[float(a), float(b)] for a, b in prior_components])
            if comps.size == 0 or not (comps > 0).all():
                raise ValueError(f"prior_components={prior_components!r}: (alpha, beta) > 0")
            self.prior_components = [list(map(float, c)) for c in comps]
            self._mix_a, self._mix_b = comps[:, 0], comps[:, 1]
        self.life_prior = None if life_prior is None else [float(x) for x in life_prior]
        self.lives = None if life_prior is None else LifeShapePosterior(self.life_prior)
        self.prior_mtbf = float(prior_mtbf)
        self.prior_strength = float(prior_strength)
        self.confidence = confidence
        self.forget_halflife = forget_halflife
        self.alpha0 = prior_strength / prior_mtbf
        self.beta0 = float(prior_strength)
        self.alpha, self.beta = self.alpha0, self.beta0
        self._a0 = self._b0 = 0.0
        if prior_availability is not None:
            self._a0 = prior_availability * availability_strength
            self._b0 = (1.0 - prior_availability) * availability_strength
        self._a, self._b = self._a0, self._b0
        self._clock = ExposureClock()

    @classmethod
    def from_traces(
        cls, traces: TraceSource = None, zone: str | None = None, **kwargs: Any
    ) -> GammaPoissonRate:
        """Prior rate and availability pooled over historical traces (of one zone).

        Unless given: ``prior_strength`` is fitted to the spread of the traces' rates (a
        prior as uncertain as zones differ, :func:`~.lifetime.rate_prior`; ``None`` fits
        too), and then the prior is the mixture of one Gamma per trace of
        :func:`~.lifetime.rate_mixture` (``prior_components=None``: the one Gamma);
        ``life_prior`` is fitted to the dispersion of their lives (:func:`~.lifetime.shape_prior`).
        """
        found = resolve_traces(traces, zone)
        count, exposure = pooled_rate(found)
        up, n = pooled_availability(found)
        # No preemption in the history: act as if half of one had been seen (a finite MTBF).
        kwargs.setdefault("prior_mtbf", exposure / max(count, 0.5))
        kwargs.setdefault("prior_availability", up / n)
        if kwargs.get("prior_strength") is None:
            kwargs["prior_strength"] = rate_prior(found)[1]
            kwargs.setdefault("prior_components", rate_mixture(found))
        if "life_prior" not in kwargs:
            kwargs["life_prior"] = shape_prior(found)
        return cls(**kwargs)

    @property
    def prior_lives(self) -> float:
        """What the prior is worth in lives: the preemptions it counts as seen (``α₀``; with
        a mixture, its components' mean ``α``), each weighed against one of the job's own."""
        if self.prior_components is None:
            return self.alpha0
        return float(np.mean(self._mix_a))

    def mean_rate(self) -> float:
        """The posterior mean rate (what ``predict().rate.value`` is), without quantiles."""
        if self.prior_components is None:
            return self.alpha / self.beta
        w, a, b = self._mixture()
        return float((w * a / b).sum())

    def _mixture(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Posterior weights and Gamma parameters of the components, after ``n`` preemptions
        in ``T`` s: ``w_i ∝ Γ(α_i+n)/Γ(α_i) · β_i^α_i / (β_i+T)^(α_i+n)``."""
        # Imported here, not at the top: scipy costs every pcframe process ~0.3 s to import,
        # and most never reach this (the first use pays it once).
        from scipy.special import gammaln

        n = max(self.alpha - self.alpha0, 0.0)
        t = max(self.beta - self.beta0, 0.0)
        a, b = self._mix_a, self._mix_b
        log_w = gammaln(a + n) - gammaln(a) + a * np.log(b) - (a + n) * np.log(b + t)
        w = np.exp(log_w - log_w.max())
        return w / w.sum(), a + n, b + t

    def mtbf_at_age(self, age: float, mtbf: float) -> float:
        """1 / hazard ``age`` seconds into a life whose mean is ``mtbf`` (Poisson: ``mtbf``)."""
        return mtbf if self.lives is None else self.lives.mtbf_at_age(age, mtbf)

    def observe_life(self, lo: float, hi: float) -> None:
        """A life of the job ended between ages ``lo`` and ``hi`` s (updates the shape)."""
        if self.lives is not None:
            self.lives.observe(lo, hi)

    def _forget(self, dt: float) -> None:
        if self.forget_halflife is None or dt <= 0:
            return
        k = math.exp(-dt * math.log(2.0) / self.forget_halflife)
        # Decay the evidence towards the prior, never below it.
        self.alpha = self.alpha0 + (self.alpha - self.alpha0) * k
        self.beta = self.beta0 + (self.beta - self.beta0) * k

    def advance(self, now: float) -> None:
        dt = self._clock.advance(now)
        self._forget(dt)
        self.beta += dt

    def observe(self, event: Event) -> None:
        dt, n = self._clock.observe(event)
        self._forget(dt)
        self.beta += dt
        self.alpha += n

    def observe_capacity(self, now: float, up: int, capacity: int) -> None:
        if capacity > 0:
            x = min(max(up / capacity, 0.0), 1.0)
            self._a += x
            self._b += 1.0 - x

    def predict(self, now: float | None = None) -> Prediction:
        tail = (1.0 - self.confidence) / 2.0
        alpha, beta = self.alpha, self.beta
        if self.prior_components is not None:  # quantiles of the moment-matched Gamma
            w, a, b = self._mixture()
            mean = float((w * a / b).sum())
            var = float((w * (a / b**2 + (a / b) ** 2)).sum()) - mean * mean
            alpha, beta = mean * mean / max(var, 1e-300), mean / max(var, 1e-300)
        lo = gamma_quantile(tail, alpha, beta)
        hi = gamma_quantile(1.0 - tail, alpha, beta)
        rate = clamp_estimate(alpha / beta, lo, hi, self.confidence)
        avail = None
        if self._a > 0 and self._b > 0:
            m = self._a / (self._a + self._b)
            avail = clamp_estimate(
                m,
                beta_quantile(tail, self._a, self._b),
                beta_quantile(1.0 - tail, self._a, self._b),
                self.confidence,
            )
        elif self._a + self._b > 0:  # every sample at one extreme: a degenerate Beta
            m = 1.0 if self._a > 0 else 0.0
            avail = Estimate(m, m, m, self.confidence)
        return Prediction(rate, avail)

    def state_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "beta": self.beta,
            "avail": [self._a, self._b],
            "clock": self._clock.state_dict(),
            **({} if self.lives is None else {"lives": self.lives.state_dict()}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha = float(state.get("alpha", self.alpha0))
        self.beta = float(state.get("beta", self.beta0))
        self._a, self._b = (float(x) for x in state.get("avail", [self._a0, self._b0]))
        self._clock.load_state_dict(state.get("clock", {}))
        if self.lives is not None:
            self.lives.load_state_dict(state.get("lives", {}))
