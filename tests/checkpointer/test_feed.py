"""The policy feed: one EWMA, iteration-time samples, save bookkeeping, the context it builds."""

from __future__ import annotations

import pytest

from pcframe.feed import EWMA_WEIGHT, PolicyFeed, ewma
from pcframe.policies.base import Notice, PolicyContext


def test_ewma_starts_at_the_first_sample_and_weighs_the_newest_by_the_constant() -> None:
    assert EWMA_WEIGHT == 0.3
    assert ewma(None, 5.0) == 5.0
    assert ewma(10.0, 20.0) == pytest.approx(13.0)
    assert ewma(10.0, 20.0) == (1 - EWMA_WEIGHT) * 10.0 + EWMA_WEIGHT * 20.0  # bit for bit
    assert ewma(10.0, 20.0, weight=0.5) == 15.0
    value = None
    for sample in (1.0, 2.0, 3.0):
        value = ewma(value, sample)
    assert value == pytest.approx(0.7 * (0.7 * 1.0 + 0.3 * 2.0) + 0.3 * 3.0)


def test_a_fresh_feed_has_measured_nothing() -> None:
    ctx = PolicyFeed().context(0, 100.0)
    assert ctx == PolicyContext(step=0, now=100.0)
    assert ctx.iteration_time is None and ctx.save_stall is None and ctx.save_duration is None
    assert ctx.restart_cost is None and ctx.last_save_step is None and ctx.last_save_time is None


def test_iteration_time_is_sampled_per_step_only_when_the_step_advances() -> None:
    feed = PolicyFeed()
    feed.stepped(10, 100.0)
    assert feed.iteration_time is None  # one call: nothing to compare with
    feed.stepped(14, 108.0)
    assert feed.iteration_time == 2.0  # (108 - 100) / (14 - 10)
    feed.stepped(14, 500.0)  # same step: no sample...
    assert feed.iteration_time == 2.0
    feed.stepped(15, 504.0)  # ...but the clock was reset to that call: (504 - 500) / 1
    assert feed.iteration_time == pytest.approx(0.7 * 2.0 + 0.3 * 4.0)
    before = feed.iteration_time
    feed.stepped(3, 510.0)  # a step going back: no sample either
    assert feed.iteration_time == before
    feed.stepped(4, 511.0)
    assert feed.iteration_time == pytest.approx(0.7 * before + 0.3 * 1.0)


def test_resumed_resets_the_iteration_clock_and_records_the_restore() -> None:
    feed = PolicyFeed()
    feed.stepped(1, 0.0)
    feed.stepped(2, 1.0)
    assert feed.iteration_time == 1.0
    feed.resumed(50, restart_cost=90.0)
    feed.stepped(51, 1000.0)  # the restart is not a step: no sample of (1000 - 1) / 49
    assert feed.iteration_time == 1.0
    feed.stepped(52, 1003.0)
    assert feed.iteration_time == pytest.approx(0.7 * 1.0 + 0.3 * 3.0)
    ctx = feed.context(52, 1003.0)
    assert ctx.restart_cost == 90.0
    assert ctx.last_save_step == 50  # the restored checkpoint
    assert ctx.last_save_time is None  # its time is not known in this process


def test_saves_and_commits_feed_the_context() -> None:
    feed = PolicyFeed()
    feed.saved(7, 70.5)
    ctx = feed.context(8, 71.0)
    assert (ctx.last_save_step, ctx.last_save_time) == (7, 70.5)
    assert ctx.save_stall is None and ctx.save_duration is None  # started, not durable
    feed.committed(stall=0.5, durable=12.0)
    feed.committed(stall=1.5, durable=2.0)
    ctx = feed.context(9, 80.0)
    assert ctx.save_stall == pytest.approx(0.7 * 0.5 + 0.3 * 1.5)
    assert ctx.save_duration == pytest.approx(0.7 * 12.0 + 0.3 * 2.0)
    assert ctx.iteration_time is None  # commits are not steps


def test_context_passes_through_what_the_feed_does_not_measure() -> None:
    notice = Notice(received_at=5.0, deadline=35.0)
    feed = PolicyFeed(iteration_time=1.25)  # known, not measured (the simulator's case)
    ctx = feed.context(
        3,
        6.0,
        notice=notice,
        wall_time=1.7e9,
        in_flight=2,
        tier_write_times={"remote": 40.0},
        preemption_rate=1e-4,
    )
    assert ctx == PolicyContext(
        step=3,
        now=6.0,
        iteration_time=1.25,
        notice=notice,
        wall_time=1.7e9,
        in_flight=2,
        tier_write_times={"remote": 40.0},
        preemption_rate=1e-4,
    )
    assert feed.context(3, 6.0).tier_write_times == {}
    assert feed.context(3, 6.0).tier_write_times is not feed.context(3, 6.0).tier_write_times
