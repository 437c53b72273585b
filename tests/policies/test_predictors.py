"""Predictors: the estimates are right, the intervals cover, history and own events both count."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

import pcframe.policies as P
from pcframe.policies import Preempted, Restarted
from pcframe.policies.predictors import poisson_interval
from pcframe.policies.traces import Trace, load_traces


def run_poisson(p: P.Predictor, rate: float, hours: float, seed: int, t0: float = 0.0) -> int:
    """Expose ``p`` to a Poisson process of ``rate``/s for ``hours``; returns the event count."""
    rng = np.random.default_rng(seed)
    t, end, n = t0, t0 + hours * 3600.0, 0
    while True:
        nxt = t + rng.exponential(1.0 / rate)
        for s in np.arange(t, min(nxt, end), 60.0):  # the engine calls decide every minute
            p.advance(float(s))
        if nxt >= end:
            p.advance(end)
            return n
        p.observe(Preempted(nxt))
        p.observe(Restarted(nxt + 30.0, 30.0))  # downtime is not exposure
        t = nxt + 30.0
        n += 1


def test_garwood_interval_known_values() -> None:
    # 10 events in 1000 s, 90 % exact interval: chi2 quantiles / 2T (textbook values).
    lo, hi = poisson_interval(10, 1000.0, 0.9)
    assert lo == pytest.approx(0.005425, rel=1e-3)
    assert hi == pytest.approx(0.016962, rel=1e-3)
    lo0, hi0 = poisson_interval(0, 1000.0, 0.9)
    assert lo0 == 0.0 and hi0 == pytest.approx(-np.log(0.05) / 1000.0, rel=1e-6)


def test_windowed_poisson_is_the_mle_and_its_interval_covers() -> None:
    rate, covered, trials = 1 / 1800.0, 0, 60
    for seed in range(trials):
        p = P.WindowedPoisson(window=1e9, confidence=0.9)
        run_poisson(p, rate, 24.0, seed)
        est = p.predict().rate
        covered += est.lower <= rate <= est.upper
    assert covered / trials >= 0.85  # Garwood is conservative: nominal 0.9


def test_windowed_poisson_forgets_outside_the_window() -> None:
    p = P.WindowedPoisson(window=3600.0)
    for t in range(0, 3600, 60):
        p.advance(float(t))
    for k in range(5):
        p.observe(Preempted(3600.0 + k))
        p.observe(Restarted(3601.0 + k, 1.0))
    assert p.predict(3700.0).rate.value > 0
    for t in range(3700, 3700 + 7200, 60):
        p.advance(float(t))
    assert p.predict(3700.0 + 7200.0).rate.value == 0.0  # the storm left the window


def test_ewma_tracks_a_change_of_regime() -> None:
    p = P.EwmaRate(halflife=2 * 3600.0)
    run_poisson(p, 1 / 600.0, 12.0, seed=1)
    stormy = p.predict().rate.value
    run_poisson(p, 1 / 36000.0, 24.0, seed=2, t0=13 * 3600.0)
    calm = p.predict().rate.value
    assert stormy == pytest.approx(1 / 600.0, rel=0.5)
    assert calm < stormy / 5


def test_gamma_poisson_posterior() -> None:
    p = P.GammaPoissonRate(prior_mtbf=3600.0, prior_strength=7200.0)  # Gamma(2, 7200)
    assert p.predict().rate.value == pytest.approx(1 / 3600.0)
    p.advance(0.0)
    p.advance(1800.0)
    for k in range(4):
        p.observe(Preempted(1800.0 + k))
    # posterior Gamma(2 + 4, 7200 + 1800)
    est = p.predict().rate
    assert est.value == pytest.approx(6 / 9000.0)
    assert est.lower < est.value < est.upper


def test_gamma_poisson_converges_to_the_true_rate() -> None:
    p = P.GammaPoissonRate(prior_mtbf=36000.0, prior_strength=3600.0)
    run_poisson(p, 1 / 1200.0, 72.0, seed=5)
    assert p.predict().rate.value == pytest.approx(1 / 1200.0, rel=0.2)


def test_availability_estimates() -> None:
    for p in (P.WindowedPoisson(), P.EwmaRate(), P.GammaPoissonRate()):
        assert p.predict().availability is None  # nothing seen: cannot tell
        for i in range(200):
            p.observe_capacity(float(i * 60), up=3 if i % 4 else 1, capacity=4)
        a = p.predict(200 * 60.0).availability
        assert a is not None and a.value == pytest.approx(0.625, abs=0.05), type(p).__name__
        assert a.lower < a.value < a.upper


def _tod_trace(zone: str, stormy_hour: int, days: int = 30) -> Trace:
    up = np.ones(days * 24, dtype=np.int64)  # hourly ticks
    for d in range(days):
        up[d * 24 + stormy_hour] = 0
        up[d * 24 + (stormy_hour + 12) % 24] = 0 if d % 10 == 0 else 1
    start = datetime(2025, 3, 1, tzinfo=UTC)
    return Trace(zone, "test", 3600.0, 1, up, start_time=start, zone=zone)


def test_hazard_by_time_of_day_and_zone() -> None:
    traces = [_tod_trace("zone-a", 3), _tod_trace("zone-b", 15)]
    a = P.HazardByTimeOfDay(traces, zone="zone-a", prior_strength=3600.0)
    at = lambda h: datetime(2025, 5, 1, h, 30, tzinfo=UTC).timestamp()  # noqa: E731
    assert a.predict(at(3)).rate.value > 5 * a.predict(at(10)).rate.value
    assert a.predict(at(3)).availability.value < a.predict(at(10)).availability.value  # type: ignore[union-attr]
    b = P.HazardByTimeOfDay(traces, zone="zone-b", prior_strength=3600.0)
    assert b.predict(at(15)).rate.value > 5 * b.predict(at(3)).rate.value
    with pytest.raises(ValueError, match="zones present: zone-a, zone-b"):
        P.HazardByTimeOfDay(traces, zone="zone-c")
    with pytest.raises(ValueError, match="start time"):
        P.HazardByTimeOfDay([Trace("x", "t", 60.0, 1, np.ones(5, dtype=np.int64))])


def test_hazard_learns_from_own_preemptions_in_their_hour() -> None:
    p = P.HazardByTimeOfDay([_tod_trace("z", 3)], prior_strength=3600.0)
    noon = datetime(2025, 5, 1, 12, 0, tzinfo=UTC).timestamp()
    before = p.predict(noon + 60).rate.value
    for k in range(10):
        p.advance(noon + 300 * k)
        p.observe(Preempted(noon + 300 * k + 100))
    assert p.predict(noon + 60).rate.value > 3 * before


def test_from_shipped_traces(traces_dir: Path) -> None:
    h100 = load_traces(traces_dir / "skynomad" / "gcp-h100-16-2025")
    g = P.GammaPoissonRate.from_traces(h100, prior_components=None)  # one Gamma
    pooled = sum(t.preemption_count() for t in h100) / sum(t.up_seconds() for t in h100)
    assert g.predict().rate.value == pytest.approx(pooled)
    # The mixture (the default): one component per trace, so the prior mean is the mean of
    # the traces' own rates, each trace weighing the same.
    mix = P.GammaPoissonRate.from_traces(h100)
    rates = [(t.preemption_count() + 0.5) / t.up_seconds() for t in h100]
    assert mix.predict().rate.value == pytest.approx(np.mean(rates))
    one = P.GammaPoissonRate.from_traces(h100, zone="us-east4-a")
    assert one.predict().rate.value > g.predict().rate.value  # the stormiest H100 zone
    hz = P.HazardByTimeOfDay(traces_dir / "skynomad" / "gcp-h100-16-2025")
    rates = hz.rate_by_bin()
    assert rates.shape == (24,) and (rates > 0).all()
    assert hz.predict().rate.value == pytest.approx(pooled)


@pytest.mark.parametrize(
    "build",
    [
        lambda: P.GammaPoissonRate(math.nan),
        lambda: P.EwmaRate(prior_mtbf=math.nan),
        lambda: P.WindowedPoisson(prior_mtbf=math.nan),
        lambda: P.PreemptionAware(mtbf_prior=math.nan),
        lambda: P.Daly(mtbf=3600.0, min_interval=math.nan),
        lambda: P.Daly(mtbf=3600.0, max_interval=math.nan),
    ],
    ids=["gamma", "ewma", "windowed", "preemption-aware", "min-interval", "max-interval"],
)
def test_a_nan_prior_or_bound_is_refused(build) -> None:
    """NaN passed every `<= 0` check: a prior of NaN planned the 6 h maximum interval."""
    with pytest.raises(ValueError, match="nan"):
        build()


def test_preemption_aware_names_its_own_argument() -> None:
    with pytest.raises(ValueError, match=r"^mtbf_prior=nan must be a finite number"):
        P.PreemptionAware(mtbf_prior=math.nan)


class _CarelessPredictor(P.Predictor):
    """A user's predictor whose ``predict`` answers something else than a Prediction."""

    name = "careless_test_predictor"

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def predict(self, now: float | None = None) -> P.Prediction:
        return self.answer  # type: ignore[return-value]


CARELESS_PREDICTIONS = [
    None,
    1e-4,  # the rate alone
    P.Prediction(P.Estimate(-1.0, -2.0, 0.0)),  # a negative rate: PA never saved
    P.Prediction(P.Estimate(1e-4, 1e-5, 1e-3), availability=P.Estimate(5.0, -3.0, 7.0)),
]


@pytest.mark.parametrize("answer", CARELESS_PREDICTIONS)
def test_a_prediction_breaking_the_contract_names_the_predictor(answer: object) -> None:
    """Predictor is a plugin point: its ``predict`` was used unchecked, an AttributeError
    ('NoneType' object has no attribute 'rate') inside PreemptionAware or the simulator, or
    a negative rate taken as no preemption at all (PA then never saved). Now a PolicyError
    naming the predictor's class, in PA and in the simulator (which feeds the resource
    policy), as the conformance kit states the contract."""
    from pcframe.errors import PolicyError
    from pcframe.sim import simulate
    from pcframe.sim.spec import JobSpec

    trace = Trace(name="t", source="x", step_seconds=60.0, capacity=1, up=np.ones(20, int))
    match = "_CarelessPredictor.predict returned"
    with pytest.raises(PolicyError, match=match):
        P.PreemptionAware(predictor=_CarelessPredictor(answer), bound="upper").decide(
            P.PolicyContext(step=1, now=0.0)
        )
    with pytest.raises(PolicyError, match=match):
        simulate(
            trace,
            P.FixedSteps(10),
            JobSpec(restart_cost=10.0),
            predictor=_CarelessPredictor(answer),
            resource=P.HybridAvailability(),
        )


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: P.EwmaRate(halflife=math.nan), "halflife"),
        (lambda: P.WindowedPoisson(window=math.nan), "window"),
        (lambda: P.GammaPoissonRate(forget_halflife=math.nan), "forget_halflife"),
        (lambda: P.GammaPoissonRate(availability_strength=-1.0), "availability_strength"),
        (lambda: P.GammaPoissonRate(availability_strength=math.nan), "availability_strength"),
        (lambda: P.PreemptionAware(reevaluate_every=math.nan), "reevaluate_every"),
    ],
)
def test_nan_and_negative_seconds_are_refused_naming_the_key(make, key) -> None:
    """NaN passed the ``<= 0`` checks: the predictor was built, and its first prediction
    raised 'Estimate needs lower <= value <= upper, got Estimate(value=nan, ...)', naming
    no key (a negative availability_strength did the same)."""
    with pytest.raises(ValueError, match=key):
        make()
