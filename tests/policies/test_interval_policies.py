"""Behaviour of the periodic interval policies: what they learn and where they clamp."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import pcframe.policies as P
from pcframe.policies import PolicyContext, Restarted, SaveCompleted
from pcframe.policies.theory import daly_interval_exact, young_interval


def ctx(step: int, now: float, **kw: float) -> PolicyContext:
    return PolicyContext(step=step, now=now, **kw)


def saves(policy: P.IntervalPolicy, seconds: float, dt: float = 1.0, **kw: float) -> list[float]:
    """Times at which ``policy`` saves over ``seconds`` of steps ``dt`` apart."""
    out = []
    for i in range(int(seconds / dt)):
        if policy.decide(ctx(i, i * dt, **kw)).save:
            out.append(i * dt)
    return out


def test_fixed_steps() -> None:
    p = P.FixedSteps(every=5)
    assert [s for s in range(1, 21) if p.decide(ctx(s, s)).save] == [5, 10, 15, 20]
    assert not p.decide(ctx(0, 0)).save
    with pytest.raises(ValueError, match="every"):
        P.FixedSteps(every=0)
    for not_steps in (2.5, True, "10"):  # 2.5 saved every 5 steps, True at every step
        with pytest.raises(ValueError, match="whole number of steps"):
            P.FixedSteps(every=not_steps)
    assert P.FixedSteps(every=np.int64(7)).every == 7


def test_fixed_time_is_fixed_even_when_saves_are_slow() -> None:
    p = P.FixedTime(seconds=10.0)
    p.observe(SaveCompleted(1, 1, 0.0, stall=1.0, duration=50.0, nbytes=1))
    t = saves(p, 100.0)
    assert t == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0]


def test_young_uses_the_prior_then_the_measured_cost() -> None:
    p = P.Young(mtbf=3600.0, stall_prior=2.0, duration_prior=0.0)
    p.decide(ctx(0, 0.0))
    assert p.last_interval == pytest.approx(young_interval(2.0, 3600.0))
    # the engine's ctx value beats the prior...
    p.decide(ctx(1, 1.0, save_stall=8.0))
    assert p.last_interval == pytest.approx(young_interval(8.0, 3600.0))
    # ...and the policy's own samples beat both
    p.observe(SaveCompleted(1, 1, 2.0, stall=18.0, duration=1.0, nbytes=1))
    p.decide(ctx(2, 2.0, save_stall=8.0))
    assert p.last_interval == pytest.approx(young_interval(18.0, 3600.0))


def test_daly_uses_the_engine_rate_when_given() -> None:
    p = P.Daly(mtbf=3600.0, stall_prior=300.0, duration_prior=0.0)
    p.decide(ctx(0, 0.0))
    assert p.last_interval == pytest.approx(1276.9, abs=0.05)
    p.decide(ctx(1, 1.0, preemption_rate=1 / 900.0))
    assert p.last_interval == pytest.approx(daly_interval_exact(300.0, 900.0))
    q = P.Daly(
        mtbf=3600.0, form="series", use_context_rate=False, stall_prior=300.0, duration_prior=0.0
    )
    q.decide(ctx(0, 0.0, preemption_rate=1 / 900.0))
    assert q.last_interval == pytest.approx(1276.5, abs=0.05)


def test_clamps_and_in_flight_floor() -> None:
    # Stall ~0 (fully asynchronous) would make Young save every step; the time to durable
    # divided by the checkpoints allowed in flight is the real floor.
    p = P.Young(mtbf=3600.0, stall_prior=0.0, duration_prior=30.0, concurrency=2)
    p.decide(ctx(0, 0.0))
    assert p.last_interval == pytest.approx(15.0)
    q = P.Young(mtbf=1e9, stall_prior=10.0, max_interval=600.0)
    q.decide(ctx(0, 0.0))
    assert q.last_interval == 600.0
    r = P.Young(mtbf=1.0, stall_prior=0.01, min_interval=5.0, concurrency=None)
    r.decide(ctx(0, 0.0))
    assert r.last_interval == 5.0
    with pytest.raises(ValueError, match="concurrency"):
        P.Young(concurrency=0)
    with pytest.raises(ValueError, match="concurrency"):
        P.Young(concurrency="two")


@pytest.mark.parametrize(("engine_n", "floor"), [(None, 30.0), (1, 30.0), (2, 15.0), (3, 10.0)])
def test_default_floor_follows_the_engines_checkpoints_in_flight(engine_n, floor) -> None:
    # concurrency="engine" (the default): the floor is time-to-durable / the engine's own
    # max_in_flight, 1 where the caller does not say; an explicit number overrides it.
    p = P.Daly(mtbf=3600.0, stall_prior=0.0, duration_prior=30.0)
    p.decide(ctx(0, 0.0, max_in_flight=engine_n))
    assert p.last_interval == pytest.approx(floor)
    q = P.Daly(mtbf=3600.0, stall_prior=0.0, duration_prior=30.0, concurrency=1)
    q.decide(ctx(0, 0.0, max_in_flight=engine_n))
    assert q.last_interval == pytest.approx(30.0)


def test_the_engine_tells_policies_its_max_in_flight(tmp_path) -> None:
    import torch

    from pcframe import Checkpointer

    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), max_in_flight=3) as ckpt:
        assert ckpt.context(0).max_in_flight == 3


def test_interval_restarts_from_a_restore() -> None:
    p = P.FixedTime(seconds=10.0)
    assert saves(p, 25.0) == [10.0, 20.0]
    p.observe(Restarted(time=100.0, restart_cost=30.0, step=20))
    assert not p.decide(ctx(21, 105.0)).save
    assert p.decide(ctx(22, 110.0)).save


def test_overhead_budget_keeps_stall_within_budget() -> None:
    p = P.OverheadBudget(budget=0.05, stall_prior=1.0)
    now, stalled, step = 0.0, 0.0, 0
    true_stall = 2.0  # the prior is off by 2x: the policy must learn it
    while now < 3600.0:
        if p.decide(ctx(step, now)).save:
            p.observe(SaveCompleted(step, step, now, true_stall, 5.0, 1))
            now += true_stall
            stalled += true_stall
        now += 0.5
        step += 1
    assert p.stall_fraction() == pytest.approx(stalled / now, rel=0.02)
    assert 0.04 <= stalled / now <= 0.0505  # uses the budget but does not exceed it
    assert p.last_interval == pytest.approx(true_stall / 0.05)


def test_overhead_budget_holds_back_when_over_budget() -> None:
    p = P.OverheadBudget(budget=0.1, stall_prior=0.1, min_interval=0.0, concurrency=None)
    assert p.decide(ctx(1, 10.0)).save is False  # first call anchors
    assert p.decide(ctx(2, 11.0)).save
    p.observe(SaveCompleted(1, 2, 11.0, stall=100.0, duration=100.0, nbytes=1))  # huge stall
    assert not any(p.decide(ctx(s, 11.0 + s)).save for s in range(3, 500))


def test_overhead_budget_hints_the_interval_of_what_it_learned_while_held_back() -> None:
    """A cost learned while over budget (a restored save's completion) moves the interval;
    the hint was built from the interval of the last full decide, so the simulator's fast
    path asked later than the engine, which asks at every step."""
    p = P.OverheadBudget(budget=0.1, stall_prior=10.0, min_interval=0.0, concurrency=None)
    assert not p.decide(ctx(1, 10.0)).save
    assert p.last_interval == pytest.approx(100.0)
    p.observe(SaveCompleted(1, 1, 10.0, stall=30.0, duration=30.0, nbytes=1))  # over budget
    assert not p.decide(ctx(2, 11.0)).save
    learned = p.last_interval
    assert learned != pytest.approx(100.0)  # the interval of the cost learned meanwhile
    hint = p.save_hint(ctx(2, 11.0))
    assert hint is not None and hint.time is not None
    behind = p.stalled / p.budget - p.wall
    assert hint.time == pytest.approx(max(10.0 + learned, 11.0 + behind))


def test_checkfreq_k_rule() -> None:
    assert P.checkfreq_k(0.1, stall=0.05, duration=1.0, budget=0.05) == 10
    # (3.0 - 0.3) / 0.1 = 27, overhead 0.3 / 2.7 = 11 % > 5 %: +2 until <= 5 % -> 61
    assert P.checkfreq_k(0.1, stall=0.3, duration=3.0, budget=0.05) == 61
    assert P.checkfreq_k(1.0, stall=0.0, duration=0.0, budget=0.05) == 1


def test_checkfreq_converges_after_a_change_of_checkpoint_cost() -> None:
    p = P.CheckFreq(budget=0.05)
    stall, duration, it = 0.05, 1.0, 0.1
    intervals: list[tuple[int, int]] = []  # (step of the save, steps since the previous one)
    last = 0
    for step in range(3000):
        if step == 1500:
            stall, duration = 0.3, 3.0  # the checkpoint got 3-6x more expensive
        if p.decide(ctx(step, step * it, iteration_time=it)).save:
            intervals.append((step, step - last))
            last = step
            p.observe(SaveCompleted(len(intervals), step, step * it, stall, duration, 1))
    before = [k for s, k in intervals if s < 1500]
    after = [k for s, k in intervals if s >= 1500]
    assert before[-10:] == [10] * 10  # converged to the old optimum...
    assert p.k == 61 and after[-5:] == [61] * 5  # ...and to the new one after the change
    assert after.index(61) <= 15  # within a few saves, not eventually


def test_checkfreq_measures_iteration_time_itself() -> None:
    p = P.CheckFreq(budget=0.05, iteration_prior=10.0, stall_prior=0.0, duration_prior=2.0)
    for s in range(200):  # 0.5 s per step, no iteration_time from the engine
        p.decide(ctx(s, 0.5 * s))
    p.observe(SaveCompleted(1, 1, 100.0, stall=0.0, duration=2.0, nbytes=1))
    p.decide(ctx(200, 100.0))
    assert p.k == 4  # ceil(2.0 / 0.5)


@pytest.mark.parametrize("policy", [P.Young(), P.Daly(), P.OverheadBudget(), P.FixedTime()])
def test_state_survives_strict_json(policy: P.IntervalPolicy) -> None:
    import json

    policy.decide(ctx(0, 0.0, preemption_rate=0.0))  # an infinite MTBF must not leak as inf
    json.dumps(policy.state_dict(), allow_nan=False)


@pytest.mark.parametrize("returned", [math.nan, None, "60", True])
def test_an_interval_that_is_not_a_number_is_refused_naming_the_policy(returned):
    """NaN read as "never save" without a word (a plugin's 0/0: a job that never saved);
    None raised a nameless TypeError from math.isnan."""
    from pcframe.errors import PolicyError
    from pcframe.policies.periodic import SecondsIntervalPolicy

    class Odd(SecondsIntervalPolicy):
        def target_interval(self, ctx):
            return returned

    with pytest.raises(PolicyError, match=r"Odd\.target_interval returned .*must return seconds"):
        Odd().decide(PolicyContext(step=1, now=10.0))


@pytest.mark.parametrize("save", [math.nan, "no", None, 2])
def test_a_decision_whose_save_is_not_yes_or_no_is_refused_naming_the_policy(save):
    """Decision(float("nan")) or Decision("no") was truthy: a save at every step."""
    from pcframe.errors import PolicyError
    from pcframe.policies.base import checked_decision

    class Odd(P.FixedSteps):
        def decide(self, ctx):
            return P.Decision(save)

    with pytest.raises(PolicyError, match=r"Odd.*save and emergency must be True or False"):
        checked_decision(Odd(), Odd().decide(PolicyContext(step=1, now=10.0)))
    for yes_or_no in (True, False, np.True_, np.False_):  # numpy's booleans are fine
        assert checked_decision(Odd(), P.Decision(yes_or_no)).save == yes_or_no


class _Reasons(P.FixedSteps):
    """A plugin whose decisions carry ``reason`` as it was given."""

    def __init__(self, reason: object) -> None:
        super().__init__(every=1)
        self.reason = reason

    def decide(self, ctx):
        return P.Decision(True, self.reason)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reason", "shown"),
    [(7, "reason=7 (int)"), ({"why": 1}, "reason={'why': 1} (dict)"), (b"x", "reason=b'x'")],
)
def test_a_decision_whose_reason_is_not_text_names_the_policy_and_the_field(
    reason: object, shown: str, tmp_path
) -> None:
    """An int or dict reason was written into the version's metadata as it was, bytes failed
    as 'metadata must be JSON-able' naming no policy, and the conformance kit's bare assert
    said nothing: now one line naming the class, the field and the fix, wherever it is
    checked (the engine, the simulator and the kit all ask checked_decision)."""
    import torch

    from pcframe import Checkpointer
    from pcframe.errors import PolicyError
    from pcframe.testing.interval_conformance import IntervalDriver

    expected = rf"_Reasons\.decide returned a Decision with {re.escape(shown)}"
    with pytest.raises(PolicyError, match=expected) as raised:
        IntervalDriver().one(_Reasons(reason))
    message = str(raised.value)
    assert "\n" not in message and "must be a str" in message and "Fix: " in message
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path, model=model, policy=_Reasons(reason))
    try:
        with pytest.raises(PolicyError, match=expected):
            ckpt.maybe_save(0)
        assert ckpt.committed_versions() == [], "no version was saved for it"
    finally:
        ckpt.close()


def test_checkfreq_refuses_an_iteration_prior_of_zero_when_made() -> None:
    """iteration_prior=0 was accepted, and the first decide without a measured iteration
    time raised 'iteration time 0.0 must be > 0' out of maybe_save, naming no key."""
    with pytest.raises(ValueError, match="iteration_prior=0"):
        P.CheckFreq(iteration_prior=0)
