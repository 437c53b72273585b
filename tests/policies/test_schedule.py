"""How PA learns, part 2: the mixture prior over zones and the kept-work schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pcframe.policies as P
from pcframe.policies import Preempted
from pcframe.policies.predictors.lifetime import cycle_interval, rate_mixture
from pcframe.policies.predictors.schedule import kept_work_schedule
from pcframe.policies.theory import daly_interval_exact
from pcframe.policies.traces import Trace

HEAVY = [0.6, 0.2, 0.05, 0.05, 0.05, 0.0, 0.05]  # most weight on Lomax shapes 1.2 and 1.5


def _kept(ages: np.ndarray, taus: np.ndarray, age: float) -> float:
    return float(np.interp(age, ages, taus))


@pytest.mark.parametrize(("cost", "mtbf"), [(90.0, 600.0), (180.0, 3600.0), (4.0, 50000.0)])
def test_kept_work_schedule_is_daly_for_poisson_lives(cost: float, mtbf: float) -> None:
    ages, taus = kept_work_schedule(mtbf, cost, cost)
    want = daly_interval_exact(cost, mtbf)
    for age in (0.0, mtbf, 50.0 * mtbf):
        assert _kept(ages, taus, age) == pytest.approx(want, rel=0.02)


def test_kept_work_schedule_saves_young_vms_sooner_than_one_cycle_says() -> None:
    # A young VM of over-dispersed lives dies soon or lives long: what a save protects early
    # is the start of a long life, so the whole-life optimum saves sooner than the best
    # ratio of a single cycle, and later as the VM ages.
    ages, taus = kept_work_schedule(600.0, 90.0, 90.0, HEAVY)
    young = _kept(ages, taus, 0.0)
    assert young < 0.9 * (cycle_interval(0.0, 600.0, 90.0, 90.0, HEAVY) - 90.0)
    assert young < _kept(ages, taus, 3600.0) < _kept(ages, taus, 36000.0)
    assert young < daly_interval_exact(90.0, 600.0)  # and sooner than Poisson at the mean


def test_kept_work_schedule_maximises_expected_kept_work() -> None:
    # Monte Carlo over Lomax lives: the schedule keeps more work than the fixed interval the
    # schedule starts with, and than Daly's at the mean life.
    rng = np.random.default_rng(1)
    k, mtbf, cost = 1.2, 600.0, 90.0
    lives = (k - 1.0) * mtbf * (rng.random(40000) ** (-1.0 / k) - 1.0)
    ages, taus = kept_work_schedule(mtbf, cost, cost, [1.0, 0, 0, 0, 0, 0, 0])

    def kept(next_tau) -> float:
        total = 0.0
        for life in lives:
            age, work = 0.0, 0.0
            while True:
                tau = next_tau(age)
                if age + tau + cost > life:
                    break
                work, age = work + tau, age + tau + cost
            total += work
        return total / lives.size

    best = kept(lambda a: _kept(ages, taus, a))
    assert best > 1.02 * kept(lambda a: daly_interval_exact(cost, mtbf))
    assert best > kept(lambda a: taus[0])


def test_kept_work_schedule_with_no_failures_never_saves() -> None:
    ages, taus = kept_work_schedule(math.inf, 90.0, 90.0, HEAVY)
    assert math.isinf(_kept(ages, taus, 10.0))


def _trace(mtbf: float, name: str, hours: float = 200.0) -> Trace:
    step = 60.0
    n = int(hours * 3600 / step)
    up = np.ones(n, dtype=np.int64)
    up[np.arange(int(mtbf / step), n, int(mtbf / step) + 1)] = 0
    return Trace(name=name, source="test", zone=name, up=up, capacity=1, step_seconds=step)


def test_rate_mixture_has_one_component_per_trace_at_its_rate() -> None:
    traces = [_trace(m, f"z{i}") for i, m in enumerate((600.0, 3600.0, 36000.0, 72000.0))]
    comps = rate_mixture(traces)
    assert comps is not None and len(comps) == 4
    rates = sorted(a / b for a, b in comps)
    for got, t in zip(rates, sorted(traces, key=lambda t: -t.mtbf()), strict=True):
        assert got == pytest.approx(1.0 / t.mtbf(), rel=0.3)
    assert rate_mixture(traces[:2]) is None  # too few zones to estimate a density


def test_mixture_prior_learns_a_harsh_zone_faster_than_one_gamma() -> None:
    # Three calm zones and one harsh one: a few short lives make the mixture jump to the
    # harsh bump, while one Gamma centred between them still averages them in.
    calm = (30000.0, 36000.0, 54000.0, 72000.0, 90000.0)
    traces = [_trace(m, f"z{i}") for i, m in enumerate((600.0, *calm))]
    mix = P.GammaPoissonRate.from_traces(traces)
    one = P.GammaPoissonRate.from_traces(traces, prior_components=None)
    assert mix.prior_components is not None and one.prior_components is None
    for pred in (mix, one):
        t = 0.0
        for _ in range(3):
            pred.advance(t)
            t += 500.0
            pred.observe(Preempted(t))
    assert 1.0 / mix.mean_rate() < 1200.0
    assert 1.0 / one.mean_rate() > 1.5 / mix.mean_rate()
    est = mix.predict().rate
    assert est.lower <= est.value <= est.upper
    state = mix.state_dict()
    again = P.GammaPoissonRate.from_traces(traces)
    again.load_state_dict(state)
    assert again.mean_rate() == pytest.approx(mix.mean_rate())


def test_pa_schedule_knob_is_validated_and_both_schedules_plan() -> None:
    with pytest.raises(ValueError, match="schedule"):
        P.PreemptionAware(schedule="ratio")
    traces = [_trace(m, f"z{i}") for i, m in enumerate((600.0, 3600.0, 36000.0, 72000.0))]
    ctx = P.PolicyContext(step=1, now=0.0, save_stall=90.0, save_duration=90.0)
    taus = {}
    for schedule in ("kept_work", "cycle"):
        pol = P.PreemptionAware(P.GammaPoissonRate.from_traces(traces), schedule=schedule)
        taus[schedule] = pol.target_interval(ctx)
    assert all(math.isfinite(t) and t > 90.0 for t in taus.values())
