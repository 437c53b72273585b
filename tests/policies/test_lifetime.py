"""How PA learns: the empirical-Bayes prior, the life-shape posterior, the cycle interval."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pcframe.policies as P
from pcframe.policies import PolicyContext, Preempted, Restarted
from pcframe.policies.predictors.lifetime import (
    SHAPE_GRID,
    LifeShapePosterior,
    cycle_interval,
    fit_lomax_shape,
    lives,
    rate_prior,
    shape_prior,
)
from pcframe.policies.theory import daly_interval_exact
from pcframe.policies.traces import Trace


def _lomax(k: float, scale: float, n: int, seed: int = 0) -> np.ndarray:
    """Lomax samples by inversion: S(x) = (1 + x/scale)^-k."""
    u = np.random.default_rng(seed).random(n)
    return scale * (u ** (-1.0 / k) - 1.0)


def _trace(name: str, up: list[int], step: float = 60.0, zone: str | None = None) -> Trace:
    return Trace(name, "test", step, 1, np.array(up, dtype=np.int64), zone=zone)


def _blinking(name: str, period: int, ticks: int = 4000) -> Trace:
    """Up except one tick in every ``period``: preemptions every period ticks."""
    return _trace(name, [0 if i % period == period - 1 else 1 for i in range(ticks)], zone=name)


def test_lomax_shape_is_recovered_and_poisson_is_told_apart() -> None:
    assert fit_lomax_shape(_lomax(2.0, 3600.0, 3000)) == pytest.approx(2.0, rel=0.25)
    assert fit_lomax_shape(_lomax(1.2, 600.0, 3000, seed=1)) == pytest.approx(1.2, rel=0.25)
    poisson = np.random.default_rng(2).exponential(3600.0, 3000)
    assert fit_lomax_shape(poisson) > 20.0  # a Poisson process is the k -> inf limit
    assert math.isinf(fit_lomax_shape(np.ones(3)))  # too few lives say nothing


def test_lives_of_an_availability_trace_are_its_up_runs() -> None:
    t = _trace("t", [1, 1, 0, 1, 1, 1, 0, 0, 1])  # runs 2, 3, then one cut by the end
    assert list(lives(t)) == [120.0, 180.0]


def test_prior_weight_follows_the_spread_of_the_zones() -> None:
    same = [_blinking(f"z{i}", 50) for i in range(4)]
    spread = [_blinking(f"s{i}", p) for i, p in enumerate((5, 50, 500, 2000))]
    mtbf_same, strength_same = rate_prior(same)
    mtbf_spread, strength_spread = rate_prior(spread)
    assert mtbf_same == pytest.approx(49 * 60.0, rel=0.05)
    # Zones that agree make a confident prior (many events' worth), zones that differ by
    # orders of magnitude a weak one (about one event's worth or less).
    assert strength_same / mtbf_same > 20.0
    assert strength_spread / mtbf_spread < 1.0
    weak = P.GammaPoissonRate.from_traces(spread)
    assert weak.prior_strength == pytest.approx(strength_spread)


def test_shape_posterior_moves_to_the_lives_it_sees() -> None:
    prior = [1.0 / len(SHAPE_GRID)] * len(SHAPE_GRID)
    heavy, poisson = LifeShapePosterior(prior), LifeShapePosterior(prior)
    mtbf = 3600.0
    rng = np.random.default_rng(3)
    for x in _lomax(1.2, 0.2 * mtbf, 300, seed=4):
        heavy.observe(x, x + 60.0)  # interval-censored: died within a minute of x
    for x in rng.exponential(mtbf, 300):
        poisson.observe(x, x + 60.0)
    w_heavy, w_poisson = heavy.weights(0.0, mtbf), poisson.weights(0.0, mtbf)
    assert int(np.argmax(w_heavy)) == 0  # k = 1.2
    assert sum(w_poisson[-3:]) > 0.8  # k >= 5: near Poisson
    # Survival to a great age shifts belief towards the heavy tail (k small).
    assert heavy.mtbf_at_age(10 * mtbf, mtbf) > heavy.mtbf_at_age(0.0, mtbf)
    state = heavy.state_dict()
    again = LifeShapePosterior(prior)
    again.load_state_dict(state)
    assert again.weights(0.0, mtbf) == pytest.approx(w_heavy)


@pytest.mark.parametrize(("cost", "mtbf"), [(300.0, 3600.0), (4.0, 3600.0), (90.0, 600.0)])
def test_cycle_interval_is_daly_for_poisson_lives(cost: float, mtbf: float) -> None:
    tau = cycle_interval(0.0, mtbf, cost, cost) - cost
    assert tau == pytest.approx(daly_interval_exact(cost, mtbf), rel=0.01)
    # Poisson lives have no memory: the age does not matter.
    assert cycle_interval(5 * mtbf, mtbf, cost, cost) == pytest.approx(tau + cost, rel=0.01)


def test_cycle_interval_grows_with_age_for_over_dispersed_lives() -> None:
    heavy = [1.0] + [0.0] * (len(SHAPE_GRID) - 1)  # k = 1.2
    taus = [cycle_interval(age, 3600.0, 90.0, 90.0, heavy) for age in (0.0, 3600.0, 36000.0)]
    assert taus[0] < taus[1] < taus[2]
    assert taus[0] < cycle_interval(0.0, 3600.0, 90.0, 90.0)  # young VMs die young
    assert math.isinf(cycle_interval(0.0, math.inf, 90.0, 90.0, heavy))


def test_shape_prior_votes_for_the_traces_shapes() -> None:
    assert shape_prior([_trace("short", [1, 0, 1])]) is None  # too few lives to say
    weights = shape_prior([_blinking(f"z{i}", 50) for i in range(3)])
    assert weights is not None and sum(weights) == pytest.approx(1.0)
    assert int(np.argmax(weights)) == len(SHAPE_GRID) - 1  # equal lives: not heavy-tailed


def _ctx(now: float, step: int = 1) -> PolicyContext:
    return PolicyContext(
        step=step,
        now=now,
        save_stall=90.0,
        save_duration=90.0,
        iteration_time=1.0,
    )


def _heavy_policy() -> P.PreemptionAware:
    prior = [0.9] + [0.1 / (len(SHAPE_GRID) - 1)] * (len(SHAPE_GRID) - 1)
    pred = P.GammaPoissonRate(3600.0, prior_strength=36000.0, life_prior=prior)
    return P.PreemptionAware(pred, cost="duration", hysteresis=0.0, max_interval=None)


def test_pa_saves_sooner_on_a_young_vm_than_on_an_old_one() -> None:
    young, old = _heavy_policy(), _heavy_policy()
    young.decide(_ctx(0.0))
    old.decide(_ctx(0.0))
    old.decide(_ctx(20 * 3600.0, step=2))  # the same VM, 20 h later
    assert young.target_interval(_ctx(1.0)) < 0.7 * old.target_interval(_ctx(20 * 3600.0 + 1))
    flat = P.PreemptionAware(
        P.GammaPoissonRate(3600.0, prior_strength=36000.0), cost="duration", hysteresis=0.0
    )
    flat.decide(_ctx(0.0))
    assert flat.target_interval(_ctx(1.0)) == pytest.approx(
        daly_interval_exact(90.0, 3600.0), rel=0.01
    )


def test_pa_counts_restarts_whose_state_died_with_them() -> None:
    seen, blind = _heavy_policy(), _heavy_policy()
    for p in (seen, blind):
        p.decide(_ctx(0.0))
        p.decide(_ctx(600.0, step=2))
    seen.observe(Restarted(1000.0, 60.0, 2, unseen_starts=3))
    blind.observe(Restarted(1000.0, 60.0, 2))
    added = seen.predictor.alpha - blind.predictor.alpha
    assert added == pytest.approx(3.0)  # three more preemptions, each with a little exposure
    assert seen.predictor.beta - blind.predictor.beta < 3 * 3600.0
    assert len(seen.predictor.lives.lives) == len(blind.predictor.lives.lives) + 3


def test_pa_state_round_trips_with_the_life_posterior() -> None:
    p = _heavy_policy()
    p.decide(_ctx(0.0))
    p.observe(Preempted(500.0))
    p.observe(Restarted(700.0, 60.0, 1))
    p.decide(_ctx(800.0, step=2))
    q = _heavy_policy()
    q.load_state_dict(p.state_dict())
    assert q.predictor.lives.lives == p.predictor.lives.lives
    assert q.target_interval(_ctx(900.0, 3)) == pytest.approx(p.target_interval(_ctx(900.0, 3)))
