"""What the simulator tells policies beyond the engine's basics, and its jitter model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pcframe.policies as P
from pcframe.policies import Restarted
from pcframe.policies.traces import Trace
from pcframe.sim import JobSpec, Oracle, SimConfigError, SimOptions, simulate

from .helpers import H100, shipped


class Recording(P.FixedSteps):
    """FixedSteps that records every Restarted event it is shown (outside its state)."""

    def __init__(self, every: int, log: list[Restarted]) -> None:
        super().__init__(every)
        self.log = log

    def observe(self, event) -> None:
        if isinstance(event, Restarted):
            self.log.append(event)


def _kills_at(seconds: list[int], horizon: int) -> Trace:
    up = np.ones(horizon, dtype=np.int64)
    up[seconds] = 0
    return Trace("kills", "test", 1.0, 1, up)


def test_restarts_count_the_lives_that_died_before_committing() -> None:
    # Lives: 2000 s (commits at 600-step intervals), then two of 400 s (120 s restart, 280 s
    # of training: never a commit), then the rest.
    trace = _kills_at([2000, 2401, 2802], 6000)
    job = JobSpec(iteration_time=1.0, save_stall=1.0, save_duration=5.0, restart_cost=120.0)
    log: list[Restarted] = []
    simulate(trace, Recording(600, log), job)
    assert [e.unseen_starts for e in log] == [0, 1, 2]
    assert {e.step for e in log} == {1800}  # all restored the first life's last commit
    # A policy living through the job (supervisor-held) saw everything itself.
    log.clear()
    simulate(trace, Recording(600, log), job, options=SimOptions(policy_state="process"))
    assert all(e.unseen_starts == 0 for e in log) and len(log) == 3


def test_a_process_killed_while_starting_is_not_an_unseen_life() -> None:
    # The second process dies 60 s into its 120 s restart: it never trained.
    trace = _kills_at([2000, 2061], 5000)
    job = JobSpec(iteration_time=1.0, save_stall=1.0, save_duration=5.0, restart_cost=120.0)
    log: list[Restarted] = []
    simulate(trace, Recording(600, log), job)
    assert [e.unseen_starts for e in log] == [0]


def test_notice_saves_go_to_the_surviving_tier_and_the_oracle_stays_on_top() -> None:
    trace = shipped(H100)
    base = JobSpec(
        iteration_time=2.0,
        save_stall=6.0,
        save_duration=180.0,
        restart_cost=600.0,
        notice_window=30.0,
    )
    fast = dataclasses.replace(base, survivor_tier_duration=15.0)
    plain = simulate(trace, P.NoticeDriven(P.Daly(mtbf=7200.0)), base)
    tiered = simulate(trace, P.NoticeDriven(P.Daly(mtbf=7200.0)), fast)
    assert plain.emergency_saves == 0  # 180 s never fits in 30 s
    # Many of this zone's preemptions hit a VM still booting (600 s): nothing to save.
    assert tiered.emergency_saves > 0.3 * tiered.preemptions
    assert tiered.goodput > 1.01 * plain.goodput
    assert simulate(trace, Oracle(), fast).goodput >= tiered.goodput
    # Learned: notices secure almost every preemption, so PA checkpoints far less often.
    notice_pa = P.NoticeDriven(P.PreemptionAware(P.GammaPoissonRate(7200.0)))
    learned = simulate(trace, notice_pa, fast)
    assert notice_pa.miss_fraction() < 0.2
    assert (
        learned.saves
        < 0.7 * simulate(trace, P.PreemptionAware(P.GammaPoissonRate(7200.0)), fast).saves
    )
    assert learned.goodput >= tiered.goodput


def test_jitter_is_seeded_and_off_by_default() -> None:
    trace = shipped(H100)
    job = JobSpec(iteration_time=2.0, save_stall=6.0, save_duration=180.0, restart_cost=600.0)
    noisy = dataclasses.replace(job, restart_jitter=60.0, iteration_jitter=0.02)
    a = simulate(trace, P.FixedSteps(900), noisy, options=SimOptions(seed=1))
    b = simulate(trace, P.FixedSteps(900), noisy, options=SimOptions(seed=1))
    c = simulate(trace, P.FixedSteps(900), noisy, options=SimOptions(seed=2))
    assert a.goodput == b.goodput and a.goodput != c.goodput
    exact = simulate(trace, P.FixedSteps(900), job)
    zero = dataclasses.replace(job, restart_jitter=0.0, iteration_jitter=0.0)
    assert simulate(trace, P.FixedSteps(900), zero).goodput == exact.goodput
    # The time ledger still adds up with drawn restart and step times.
    assert sum(a.time.values()) == pytest.approx(a.wall_seconds)


@pytest.mark.parametrize(
    ("key", "value"),
    [("restart_jitter", -1.0), ("iteration_jitter", 1.5), ("survivor_tier_duration", 0.0)],
)
def test_new_job_keys_are_validated(key: str, value: float) -> None:
    with pytest.raises(SimConfigError, match=f"job.{key}"):
        JobSpec(**{key: value})


@pytest.mark.slow
def test_age_aware_pa_fast_paths_agree_with_asking_every_step() -> None:
    from pcframe.policies.traces import load_traces, shared_traces_dir

    trace = shipped(H100)
    history = [t for t in load_traces(shared_traces_dir()) if t.zone != trace.zone]
    job = JobSpec(iteration_time=2.0, save_stall=6.0, save_duration=180.0, restart_cost=600.0)
    window = SimOptions(duration=3 * 86400.0)
    slow = SimOptions(duration=3 * 86400.0, use_hints=False)

    def make() -> P.PreemptionAware:
        return P.PreemptionAware(P.GammaPoissonRate.from_traces(history))

    fast_run, slow_run = simulate(trace, make(), job, options=window), None
    slow_run = simulate(trace, make(), job, options=slow)
    assert fast_run.preemptions == slow_run.preemptions >= 5
    # The same decisions (issue 43): the hints name every re-prediction (30 s) and age bucket,
    # so the fast path asks about once per 15 steps of 2 s instead of at every step.
    assert (fast_run.useful_steps, fast_run.saves) == (slow_run.useful_steps, slow_run.saves)
    assert fast_run.goodput == pytest.approx(slow_run.goodput, rel=1e-12)
    assert fast_run.decisions < 0.1 * slow_run.decisions


def test_policies_are_told_the_jobs_checkpoints_in_flight() -> None:
    seen: set[int | None] = set()

    class Looking(P.FixedSteps):
        def decide(self, ctx):
            seen.add(ctx.max_in_flight)
            return super().decide(ctx)

    trace = _kills_at([3000], 4000)
    job = JobSpec(iteration_time=1.0, save_stall=1.0, save_duration=5.0, max_in_flight=3)
    simulate(trace, Looking(600), job)
    assert seen == {3}


class Told(P.Daly):
    """Daly (a hinted policy, the process's own path) that keeps every event it is told."""

    def __init__(self, log: list, mtbf: float = 3600.0) -> None:
        super().__init__(mtbf=mtbf)
        self.log = log
        self.known: list[int] = []  # save costs it has learnt, after each event

    def observe(self, event) -> None:
        self.log.append(event)
        super().observe(event)
        self.known.append(self.costs.duration.count)


class ToldPeriodic(P.FixedSteps):
    """FixedSteps (the periodic fast path) that keeps every event it is told."""

    def __init__(self, every: int, log: list) -> None:
        super().__init__(every)
        self.log = log

    def observe(self, event) -> None:
        self.log.append(event)


@pytest.mark.parametrize("make", [lambda log: Told(log), lambda log: ToldPeriodic(600, log)])
def test_a_restored_policy_is_told_what_the_save_of_its_version_cost(make) -> None:
    # As the engine does (tests/checkpointer/test_restored_completion.py): the state was
    # taken when the save started, so the save's completion comes before Restarted.
    trace = _kills_at([2000, 2401, 2802, 4500], 6000)
    job = JobSpec(iteration_time=1.0, save_stall=1.0, save_duration=5.0, restart_cost=120.0)
    log: list = []
    simulate(trace, make(log), job)
    restarts = [i for i, e in enumerate(log) if isinstance(e, Restarted)]
    assert len(restarts) == 4
    for i in restarts:
        done, restart = log[i - 1], log[i]
        assert isinstance(done, P.SaveCompleted) and done.time == restart.time
        assert done.step == restart.step > 0 and (done.stall, done.duration) == (1.0, 5.0)
    # Versions only count forward: each restore reports the version it loaded.
    versions = [log[i - 1].version for i in restarts]
    assert versions == sorted(versions)


class OneSavePerLife(Told):
    """Saves 4000 s after the last (or after the start): one save in a life of 4570 s."""

    def target_interval(self, ctx) -> float:
        return 4000.0


def test_lives_of_one_save_still_learn_the_save_cost() -> None:
    # Every version is written by a process that saw no save finish before it, so its state
    # holds no cost: what the restore reports is all a new process knows of the saves.
    job = JobSpec(iteration_time=1.0, save_stall=1.0, save_duration=40.0, restart_cost=30.0)
    log: list = []
    policy = OneSavePerLife(log)
    simulate(_kills_at(list(range(4600, 40000, 4600)), 40000), policy, job)
    saves = [e.version for e in log if isinstance(e, P.SaveCompleted)]
    assert len(saves) == 2 * len(set(saves))  # each: seen by its writer, reported on restore
    known = [n for e, n in zip(log, policy.known, strict=True) if isinstance(e, Restarted)]
    assert len(known) >= 5 and all(n >= 1 for n in known)
    assert policy.costs.duration.mean == 40.0
