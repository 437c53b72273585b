"""The per-tier restart model: which versions survive a preemption (the placement policy
says where each goes), the restart time of the tier a restore reads, and that nothing
changes without the new inputs."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from hydra import compose, initialize_config_module

import pcframe.policies as P
from pcframe.errors import PolicyError
from pcframe.policies import Restarted
from pcframe.policies.traces import Trace
from pcframe.sim import JobSpec, SimConfigError, SimOptions, poisson_trace, simulate
from pcframe.sim.app_config import cases_from_config, register_schemas, select_traces
from pcframe.sim.sweep import run_case
from pcframe.sim.tiers import TierFate, tier_fates

from .helpers import JOB, V100, policies, shipped
from .test_fast_forward import _case

RESTARTS = {"local": 100.0, "peers": 150.0, "remote": 400.0}
# 1 s steps, a 1 s stall and 5 s to durable per save, 120 s for a start with nothing to
# restore; restores cost what their tier costs.
TIERED = JobSpec(
    iteration_time=1.0,
    save_stall=1.0,
    save_duration=5.0,
    restart_cost=120.0,
    restart_by_tier=RESTARTS,
)


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


TWO_KILLS = _kills_at([2000, 4001], 6000)


def _restores(job: JobSpec, placement: P.PlacementPolicy | None) -> list[Restarted]:
    log: list[Restarted] = []
    simulate(TWO_KILLS, Recording(100, log), job, placement=placement)
    return log


def test_local_disk_only_loses_work_back_to_the_last_remote_version() -> None:
    # Saves every 100 steps; local disk (lost with the VM) takes each, the object store every
    # 5th version: steps 500, 1000, 1500, ... (versions are numbered above the newest one
    # that survived, as the engine numbers them, so the 5th versions stay on 500-step marks).
    log = _restores(TIERED, P.LocalPlusRemote(remote_every=5))
    assert [e.step for e in log] == [1500, 3000]
    assert [e.restart_cost for e in log] == [RESTARTS["remote"]] * 2
    # The one-tier model keeps the newest durable save: step 1800 at the first kill.
    assert _restores(dataclasses.replace(TIERED, restart_by_tier=None), None)[0].step == 1800


def test_with_nothing_surviving_the_job_starts_over() -> None:
    local_only = P.TieredPlacement([P.TierRule("local", survives_preemption=False)])
    log = _restores(dataclasses.replace(TIERED, restart_by_tier={"local": 10.0}), local_only)
    # Each restart finds nothing (step 0) and costs a fresh start, not a local restore.
    assert [(e.step, e.restart_cost) for e in log] == [(0, TIERED.restart_cost)] * 2
    r = simulate(
        TWO_KILLS, P.FixedSteps(100), TIERED, placement=P.LocalPlusRemote(remote_every=1000)
    )
    assert r.restores == {} and r.preemptions == 2


def test_peers_every_version_lose_work_back_to_the_last_version() -> None:
    peers = _restores(TIERED, P.PeersThenRemote(remote_every=5))
    plain = _restores(dataclasses.replace(TIERED, restart_by_tier=None), None)
    assert peers[0].step == plain[0].step == 1800  # the newest durable version, as before
    assert [e.restart_cost for e in peers] == [RESTARTS["peers"]] * 2
    assert [e.restart_cost for e in plain] == [TIERED.restart_cost] * 2
    # Training resumed 150 - 120 = 30 s later; at the second kill both keep the newest
    # durable save (step 3600: it was durable at 3973 s and 3943 s, the kill is at 4001 s).
    assert peers[0].time - plain[0].time == 30.0
    assert peers[1].step == plain[1].step == 3600
    r = simulate(TWO_KILLS, P.FixedSteps(100), TIERED, placement=P.PeersThenRemote())
    assert r.restores == {"peers": 2} and r.placement_policy == "peers_then_remote"
    assert r.row()["restores_peers"] == 2


def test_peer_restores_keep_more_work_than_local_plus_remote() -> None:
    trace = poisson_trace(mtbf=1800.0, hours=24.0, seed=3)
    job = dataclasses.replace(TIERED, save_duration=30.0)
    results = {
        name: simulate(trace, P.Daly(mtbf=1800.0), job, placement=make)
        for name, make in (
            ("local_remote", P.LocalPlusRemote(remote_every=5)),
            ("peers_remote", P.PeersThenRemote(remote_every=5)),
        )
    }
    assert results["peers_remote"].useful_steps > results["local_remote"].useful_steps
    assert results["peers_remote"].lost_steps < results["local_remote"].lost_steps
    assert set(results["local_remote"].restores) == {"remote"}


def test_an_emergency_save_reaches_a_surviving_tier_through_the_notice() -> None:
    # The object store never gets a routine version (every 1000th); the notice's save goes
    # there (the placement's notice rule), so each restart restores the emergency version.
    job = dataclasses.replace(TIERED, notice_window=60.0, survivor_tier_duration=10.0)
    placement = P.LocalPlusRemote(remote_every=1000)
    log: list[Restarted] = []

    class Notified(P.NoticeDriven):
        def observe(self, event) -> None:
            super().observe(event)
            if isinstance(event, Restarted):
                log.append(event)

    r = simulate(TWO_KILLS, Notified(P.FixedSteps(100), margin=2.0), job, placement=placement)
    assert r.emergency_saves == 2 and r.restores == {"remote": 2}
    assert all(e.step % 100 != 0 for e in log)  # the emergency versions, off the 100 grid
    # Without a notice nothing survives the VM: every life starts from step 0.
    silent = simulate(TWO_KILLS, P.FixedSteps(100), TIERED, placement=placement)
    assert silent.useful_steps < r.useful_steps and silent.restores == {}


def test_a_planned_changeover_secures_its_last_version() -> None:
    """A resource policy's changeover gives the VMs back after a blocking save, which is
    placed as on a notice: it reaches the object store even where routine versions never
    do, so the next start restores it (and only preemptions lose work)."""
    trace = poisson_trace(mtbf=3600.0, hours=48.0, seed=5, outage=3600.0)
    r = simulate(
        trace,
        P.FixedSteps(200),
        TIERED,
        P.HybridAvailability(min_dwell=600.0),
        P.EwmaRate(halflife=3600.0),
        placement=P.LocalPlusRemote(remote_every=1000),
    )
    assert r.changeovers > 0 and set(r.restores) == {"remote"}
    assert r.restores["remote"] >= r.changeovers


def test_defaults_reproduce_todays_numbers() -> None:
    """The new inputs absent (or empty) and, as a stronger check of the new paths, a
    placement whose only tier survives the VM at the one restart cost: the same numbers as
    the one-tier model, for every shipped policy, on a real trace with its fast paths."""
    trace = shipped(V100)
    window = SimOptions(duration=2 * 86400.0)
    mtbf = trace.mtbf()
    for name, make in policies(mtbf).items():
        base = simulate(trace, make(), JOB, options=window)
        empty = simulate(
            trace, make(), dataclasses.replace(JOB, restart_by_tier={}), options=window
        )
        kept = simulate(
            trace,
            make(),
            dataclasses.replace(JOB, restart_by_tier={"local": JOB.restart_cost}),
            options=window,
            placement=P.SingleTier("local"),  # its tier survives the VM
        )
        for other in (empty, kept):
            assert (other.useful_steps, other.lost_steps, other.saves, other.saves_lost) == (
                base.useful_steps,
                base.lost_steps,
                base.saves,
                base.saves_lost,
            ), name
            assert other.time == base.time, name
        assert base.row().keys() == empty.row().keys()  # no new columns without placement
        assert "placement_policy" not in base.row()


@pytest.mark.parametrize("placement", ["local_plus_remote", "peers_then_remote_by_time"])
def test_the_fast_paths_agree_with_placements(placement: str) -> None:
    """Saves placed from the kernel's runs and from fast-forward stretches (rolled back and
    replayed before kills) give what asking at every step gives."""
    makers = {
        "local_plus_remote": lambda: P.LocalPlusRemote(remote_every=3),
        "peers_then_remote_by_time": lambda: P.PeersThenRemote(
            remote_every=None, remote_every_seconds=900.0
        ),
    }
    trace = poisson_trace(mtbf=1800.0, hours=6.0, seed=11)
    job = dataclasses.replace(TIERED, iteration_time=0.7, save_duration=20.0)
    for policy in (
        lambda: P.FixedSteps(150),
        lambda: P.Daly(mtbf=1800.0),
        P.CheckFreq,
        lambda: P.OverheadBudget(0.05),
    ):
        runs = [
            simulate(trace, policy(), job, options=opts, placement=makers[placement]())
            for opts in (
                SimOptions(),
                SimOptions(fast_forward=False),
                SimOptions(use_hints=False),
            )
        ]
        first = runs[0]
        for other in runs[1:]:
            assert (other.useful_steps, other.saves, other.restores) == (
                first.useful_steps,
                first.saves,
                first.restores,
            ), type(policy()).__name__
            assert other.time == pytest.approx(first.time, rel=1e-9, abs=1e-6)


def test_tier_fates_follow_the_placement() -> None:
    assert tier_fates(P.PeersThenRemote()) == {
        "local": TierFate.LOST,
        "peers": TierFate.SURVIVES,
        "remote": TierFate.SURVIVES,
    }
    assert tier_fates(P.MemoryThenDisk())["local"] is TierFate.SURVIVES  # a persistent disk


def test_bad_restart_inputs_are_refused() -> None:
    with pytest.raises(SimConfigError, match="needs a placement policy"):
        simulate(TWO_KILLS, P.FixedSteps(100), TIERED)
    with pytest.raises(SimConfigError, match=r"\['disk'\] names no tier of placement"):
        simulate(
            TWO_KILLS,
            P.FixedSteps(100),
            dataclasses.replace(TIERED, restart_by_tier={"disk": 5.0}),
            placement=P.PeersThenRemote(),
        )
    with pytest.raises(SimConfigError, match=r"job\.restart_by_tier\.peers=-1"):
        JobSpec(restart_by_tier={"peers": -1})
    with pytest.raises(SimConfigError, match=r"job\.restart_by_tier"):
        JobSpec(restart_by_tier=[("peers", 1.0)])  # type: ignore[arg-type]


def _compose(*overrides: str):
    register_schemas()
    with initialize_config_module("pcframe.conf", version_base="1.3"):
        return compose("sim", overrides=list(overrides))


def test_pcframe_sim_config_takes_a_placement_and_restart_times() -> None:
    cfg = _compose(
        "traces=pccheck/gpus_trace.csv",
        "baselines=[]",
        "policy/placement=peers_then_remote",
        "sim.job.restart_by_tier={local: 300, peers: 420, remote: 900}",
    )
    (case,) = cases_from_config(cfg, select_traces(cfg.traces))
    assert case.job.restart_by_tier == {"local": 300.0, "peers": 420.0, "remote": 900.0}
    row = run_case(case).row()
    assert row["placement_policy"] == "peers_then_remote"
    assert row["p_restart_by_tier"] == '{"local": 300.0, "peers": 420.0, "remote": 900.0}'
    assert row["restores_peers"] >= 1
    plain = _compose("traces=pccheck/gpus_trace.csv", "baselines=[]")
    (case,) = cases_from_config(plain, select_traces(plain.traces))
    assert case.placement is None and case.job.restart_by_tier is None
    with pytest.raises(SimConfigError, match=r"sim\.job\.restart_by_tier needs a placement"):
        cases_from_config(_compose("sim.job.restart_by_tier={peers: 1}"), [])


def _remote_by_time(seconds: float) -> P.PeersThenRemote:
    """A stateful placement whose state decides what survives: the object store by the time
    rule, and the peers made mortal (so restores come from the object store alone)."""
    p = P.PeersThenRemote(remote_every=None, remote_every_seconds=seconds)
    p.rules = tuple(dataclasses.replace(r, survives_preemption=r.name == "remote") for r in p.rules)
    return p


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.slow
def test_the_fast_forward_changes_nothing_with_placements_on_random_jobs(seed: int) -> None:
    """As tests/sim/test_fast_forward.py, with a placement deciding what survives: stretches
    place their saves, roll the placement back with the policy, and a kill whose restore
    point a stretch made re-runs it."""
    rng = random.Random(100 + seed)
    stretches = 0
    for case in range(20):
        name, make, job, trace, options = _case(rng)
        every = rng.choice([1, 2, 5])
        seconds = rng.choice([120.0, 900.0])
        which = rng.choice(["local_plus_remote", "remote_by_time", "peers"])
        makers = {
            "local_plus_remote": lambda every=every: P.LocalPlusRemote(remote_every=every),
            "remote_by_time": lambda seconds=seconds: _remote_by_time(seconds),
            "peers": lambda every=every: P.PeersThenRemote(remote_every=every),
        }
        job = dataclasses.replace(job, restart_by_tier={"peers": 45.0, "remote": 200.0})
        fast = simulate(trace, make(), job, options=options, placement=makers[which]())
        hinted = simulate(
            trace,
            make(),
            job,
            options=dataclasses.replace(options, fast_forward=False),
            placement=makers[which](),
        )
        where = f"seed {seed} case {case}: {name}, {which}, {job}"
        assert (fast.useful_steps, fast.saves, fast.saves_lost, fast.restores) == (
            hinted.useful_steps,
            hinted.saves,
            hinted.saves_lost,
            hinted.restores,
        ), where
        assert fast.time == pytest.approx(hinted.time, rel=1e-9, abs=1e-6), where
        stretches += fast.fast_forwards
    assert stretches > 20  # the draws do exercise the fast-forward


class _Misplacing(P.PlacementPolicy):
    """A user's placement that raises, or keeps a string, from version 3 on."""

    name = "misplacing"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    @property
    def tiers(self) -> tuple[str, ...]:
        return ("local", "remote")

    def place(self, ctx: P.PlacementContext) -> P.PlacementDecision:
        if ctx.version >= 3 and self.mode == "raises":
            raise RuntimeError("boom in place")
        keep = {"local": "x"} if ctx.version >= 3 else {"local": (ctx.version,)}
        return P.PlacementDecision(("local", "remote"), keep=keep)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "wrong"),
    [
        ("raises", r"raised RuntimeError: boom in place for version 3"),
        ("keep_str", r"returned keep\['local'\]='x' for version 3, not a tuple of version"),
    ],
)
def test_a_misplacing_policy_is_refused_as_the_engine_refuses_it(mode: str, wrong: str) -> None:
    """The simulator checks each answer with the engine's own check (a raising policy was a
    bare RuntimeError here, a malformed keep was accepted)."""
    trace = poisson_trace(mtbf=3600, hours=6, seed=1)
    named = r"placement policy 'misplacing' \(tests\.sim\.test_tiers\._Misplacing\)\.place "
    with pytest.raises(PolicyError, match=named + wrong):
        simulate(trace, P.FixedSteps(100), TIERED, placement=_Misplacing(mode))
