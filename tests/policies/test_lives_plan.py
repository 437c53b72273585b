"""How PA learns, part 3: planning against the job's own lives blended with the prior."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pcframe.policies as P
from pcframe.policies import PolicyContext, Restarted
from pcframe.policies.predictors.lifetime import SHAPE_GRID, cycle_interval
from pcframe.policies.predictors.lives_plan import (
    EmpiricalLives,
    LifeBlend,
    cycle_gain,
    lives_interval,
    prior_survival,
)

POISSON = [0.0] * (len(SHAPE_GRID) - 1) + [1.0]
HEAVY = [0.6, 0.2, 0.1, 0.05, 0.05, 0.0, 0.0]


def _blend(lives=(), prior_lives=1.0, mtbf=3600.0, weights=POISSON, age=0.0) -> LifeBlend:
    return LifeBlend(EmpiricalLives(list(lives)), prior_lives, mtbf, weights, age)


def test_empirical_lives_spread_each_life_over_its_window() -> None:
    emp = EmpiricalLives([(100.0, 200.0), (300.0, 300.0 + 1e-6)])
    assert emp.survival(np.array([0.0, 100.0, 150.0, 200.0, 250.0, 400.0])) == pytest.approx(
        [2.0, 2.0, 1.5, 1.0, 1.0, 0.0], abs=1e-6
    )
    # ∫_t^∞ by quadrature, at points inside and between the ramps and past the last one.
    grid = np.linspace(0.0, 400.0, 400_001)
    for t in (0.0, 120.0, 250.0, 299.0, 500.0):
        x = grid[grid >= t]
        want = np.trapezoid(emp.survival(x), x) if x.size > 1 else 0.0
        assert float(emp.tail_integral(np.array([t]))[0]) == pytest.approx(want, abs=1e-2)


def test_a_window_is_spread_as_the_prediction_says() -> None:
    # A falling hazard (heavy Lomax) makes an early end within the window likelier than a
    # late one: more of the life is gone by the window's middle than an even spread says.
    shape = prior_survival(600.0, HEAVY)
    emp = EmpiricalLives([(100.0, 2100.0)], shape)
    even = EmpiricalLives([(100.0, 2100.0)])
    mid = np.array([1100.0])
    assert float(even.survival(mid)[0]) == pytest.approx(0.5)
    want = (shape(mid) - shape(np.array([2100.0]))) / (
        shape(np.array([100.0])) - shape(np.array([2100.0]))
    )
    assert float(emp.survival(mid)[0]) == pytest.approx(float(want[0]), abs=0.02)
    assert float(emp.survival(mid)[0]) < 0.4


@pytest.mark.parametrize(("mtbf", "stall", "durable"), [(3600.0, 90.0, 90.0), (600.0, 10.0, 90.0)])
def test_with_no_lives_it_is_the_prior_cycle_and_daly_for_poisson(mtbf, stall, durable) -> None:
    for weights in (POISSON, HEAVY):
        for age in (0.0, 5000.0):
            got = lives_interval(_blend(mtbf=mtbf, weights=weights, age=age), stall, durable)
            want = cycle_interval(age, mtbf, stall, durable, weights)
            assert got == pytest.approx(want, rel=0.02)


def test_many_equal_lives_outweigh_a_poisson_prior() -> None:
    # Every life lasts 1000 s: the best cycle trains until just before the end (one save
    # durable at 1000 s); Daly at the same mean life would save every ~140 s.
    lives = [(995.0, 1005.0)] * 60
    tau = lives_interval(_blend(lives, prior_lives=1.0, mtbf=1000.0), 10.0, 10.0)
    assert 900.0 < tau <= 1000.0
    daly = cycle_interval(0.0, 1000.0, 10.0, 10.0)
    assert daly < 200.0
    # The prior counts as prior_lives lives: worth 1000 of them, it wins back.
    heavy_prior = lives_interval(_blend(lives, prior_lives=1000.0, mtbf=1000.0), 10.0, 10.0)
    assert heavy_prior == pytest.approx(daly, rel=0.1)


def test_a_life_that_outlived_every_seen_one_follows_the_prediction() -> None:
    # Given that the VM outlived every life seen, only the
    # prediction says how it goes on (the short lives seen say nothing about it).
    short = [(50.0, 150.0)] * 40
    got = lives_interval(_blend(short, mtbf=3600.0, weights=HEAVY, age=8000.0), 30.0, 90.0)
    assert got == pytest.approx(cycle_interval(8000.0, 3600.0, 30.0, 90.0, HEAVY), rel=0.02)
    # ... while young, the same lives say it will likely die soon: save sooner (with saves
    # cheap and quick enough to be durable within such a life).
    young = lives_interval(_blend(short, mtbf=3600.0, weights=HEAVY, age=0.0), 2.0, 10.0)
    assert young < 0.8 * cycle_interval(0.0, 3600.0, 2.0, 10.0, HEAVY)


def test_cycle_gain_is_the_work_a_cycle_keeps_per_second_it_takes() -> None:
    # Lives of exactly 1000 s (no prior): a cycle of τ trained + 10 s of stall keeps τ when
    # τ + durable <= 1000 and always takes τ + stall seconds.
    blend = _blend([(1000.0, 1000.0 + 1e-6)] * 20, prior_lives=1e-12, mtbf=1000.0)
    taus = np.array([100.0, 500.0, 980.0, 995.0])
    gain = cycle_gain(blend, taus, 10.0, 10.0)
    assert gain[:3] == pytest.approx(taus[:3] / (taus[:3] + 10.0), rel=1e-6)
    assert gain[3] == pytest.approx(0.0, abs=1e-6)  # durable at 1005 s: the life is over


def test_blend_rejects_a_bad_mean_life() -> None:
    with pytest.raises(ValueError):
        _blend(mtbf=math.inf)


def test_gamma_poisson_prior_is_worth_its_pseudo_preemptions() -> None:
    assert P.GammaPoissonRate(3600.0, 7200.0).prior_lives == pytest.approx(2.0)
    mixed = P.GammaPoissonRate(prior_components=[(1.5, 600.0), (0.5, 36000.0)])
    assert mixed.prior_lives == pytest.approx(1.0)


def _pa(schedule: str) -> P.PreemptionAware:
    pred = P.GammaPoissonRate(3600.0, 3600.0, life_prior=[1.0 / len(SHAPE_GRID)] * 7)
    return P.PreemptionAware(pred, schedule=schedule, stall_prior=10.0, duration_prior=60.0)


def _young_interval(policy: P.PreemptionAware, lives: int, life: float) -> float:
    """The interval right after a restart, after ``lives`` lives of ``life`` s each."""
    now = 0.0
    for _ in range(lives):
        policy.decide(PolicyContext(step=int(now), now=now))
        now += life
        policy.decide(PolicyContext(step=int(now), now=now))
        policy.observe(Restarted(now, 60.0, int(now)))
        now += 60.0
    policy.decide(PolicyContext(step=int(now), now=now))
    return policy.interval(PolicyContext(step=int(now) + 1, now=now + 1.0))


def test_pa_plans_with_the_lives_it_has_seen() -> None:
    # Lives of exactly 1500 s, seen by the policy itself: the lives schedule learns to
    # save once, late, while the parametric cycle keeps saving at Daly-like intervals.
    lives = _young_interval(_pa("lives"), 40, 1500.0)
    cycle = _young_interval(_pa("cycle"), 40, 1500.0)
    assert lives > 2.0 * cycle
    with pytest.raises(ValueError, match="schedule"):
        P.PreemptionAware(schedule="nope")  # type: ignore[arg-type]
