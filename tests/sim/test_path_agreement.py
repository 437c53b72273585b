"""The simulator's fast path makes the decisions of the engine's every-step path (issue 43).

The engine asks its interval policy at every step; the simulator asks only where the
policy's ``save_hint`` points (plus the periodic kernel and the steady-state fast-forward).
That is an optimisation only if every shipped policy checkpoints at the same steps both
ways. ``PreemptionAware`` did not: it re-predicts on its own clock and its interval follows
the VM's age through a hysteresis, so skipping calls adopted other intervals (-3.8 to +1.1 %
of goodput per trace). ``experiments/sim/path_agreement.py`` checks every shipped trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cache

import pytest

import pcframe.policies as P
from pcframe.policies import registry
from pcframe.policies.traces import Trace, load_traces, shared_traces_dir
from pcframe.sim import JobSpec, SimOptions, poisson_trace, simulate
from tests.sim.helpers import H100, policies, shipped

ASYNC = JobSpec(
    iteration_time=2.0, save_stall=6.0, save_duration=180.0, restart_cost=600.0, notice_window=30.0
)
SYNC = dataclasses.replace(ASYNC, save_stall=180.0, max_in_flight=1)  # a blocking save


@cache
def _history() -> tuple[Trace, ...]:
    """Other zones' traces: a prior with a life shape, so PA's interval follows the age."""
    root = shared_traces_dir()
    assert root is not None, "the shipped traces (experiments/traces) are missing"
    return tuple(load_traces(root / "skynomad" / "aws-v100-availability-2023"))


def _makers(mtbf: float) -> dict[str, Callable[[], P.IntervalPolicy]]:
    makers = dict(policies(mtbf))
    makers["preemption_aware_age"] = lambda: P.PreemptionAware(
        P.GammaPoissonRate.from_traces(list(_history()))
    )
    makers["notice_pa_age"] = lambda: P.NoticeDriven(makers["preemption_aware_age"]())
    # Its interval follows the exact age: no exact hint, so it is asked at every step.
    makers["pa_kept_work"] = lambda: P.PreemptionAware(
        P.GammaPoissonRate.from_traces(list(_history())), schedule="kept_work"
    )
    return makers


def test_every_registered_interval_policy_is_covered() -> None:
    covered = {getattr(make(), "name", "") for make in _makers(3600.0).values()}
    assert set(registry.available("interval")) <= covered


def _cases() -> list:
    """Every policy on the synthetic day; on a day of a real trace PA's two flavours by
    default (their hints are the ones that follow a clock), the others in the long run
    (``pytest -m campaign``)."""
    cases = []
    for name in _makers(3600.0):
        for trace in ("synthetic", "h100-slice"):
            # Asked at every step on all paths (its hint is None): the synthetic day is enough.
            if name == "pa_kept_work" and trace != "synthetic":
                continue
            for regime in ("async", "sync"):
                default = trace == "synthetic" or name in (
                    "preemption_aware",
                    "preemption_aware_age",
                    "notice_pa_age",
                )
                marks = () if default else (pytest.mark.campaign,)
                cases.append(pytest.param(name, trace, regime, marks=marks))
    return cases


def _trace_and_window(which: str) -> tuple[Trace, dict[str, float]]:
    if which == "synthetic":  # preempted about every 2 h for a day
        return poisson_trace(mtbf=7200.0, hours=24.0, outage=900.0, seed=4), {}
    return shipped(H100), dict(start=2 * 86400.0, duration=86400.0)


@pytest.mark.parametrize(("name", "which", "regime"), _cases())
def test_fast_path_saves_at_the_steps_of_the_every_step_path(
    name: str, which: str, regime: str
) -> None:
    trace, window = _trace_and_window(which)
    job = ASYNC if regime == "async" else SYNC
    make = _makers(trace.mtbf())[name]
    runs = {
        path: simulate(trace, make(), job, options=SimOptions(**window, record_saves=True, **opts))
        for path, opts in {
            "every step": dict(use_hints=False),
            "hinted": dict(fast_forward=False),
            "fast": {},
        }.items()
    }
    slow = runs["every step"]
    assert slow.saves >= 2, "the case should checkpoint"
    assert len(slow.save_steps) == slow.saves
    for path in ("hinted", "fast"):
        r = runs[path]
        assert r.save_steps == slow.save_steps, f"{name}: {path} saves at other steps"
        assert (r.useful_steps, r.saves_lost, r.preemptions) == (
            slow.useful_steps,
            slow.saves_lost,
            slow.preemptions,
        ), f"{name}: {path}"
        assert r.goodput == pytest.approx(slow.goodput, rel=1e-9), f"{name}: {path}"


@pytest.mark.parametrize("inner", ["fixed_time", "daly"])
def test_a_notice_that_arrives_during_a_stall_is_asked_about_on_every_path(inner: str) -> None:
    """Saves that stall 15 s, notices 30 s before each kill, a tier that secures the state
    in 8 s: a notice often arrives while a save stalls the loop. The engine asks at the
    first step after the stall and saves; the fast path took a notice as a point only while
    it was ahead, so one passed during a stall was missed (-1 % of goodput on a 2-day
    trace, 91 emergency saves for 99 notices)."""
    trace = poisson_trace(mtbf=1500.0, hours=24.0, outage=20.0, seed=5)
    job = JobSpec(
        iteration_time=1.0,
        save_stall=15.0,
        save_duration=200.0,
        restart_cost=60.0,
        notice_window=30.0,
        survivor_tier_duration=8.0,
    )

    def make() -> P.IntervalPolicy:
        periodic = P.FixedTime(200.0) if inner == "fixed_time" else P.Daly(mtbf=trace.mtbf())
        return P.NoticeDriven(periodic)

    slow = simulate(trace, make(), job, options=SimOptions(use_hints=False, record_saves=True))
    fast = simulate(trace, make(), job, options=SimOptions(record_saves=True))
    assert slow.preemptions >= 20 and slow.emergency_saves >= 0.8 * slow.preemptions
    assert fast.save_steps == slow.save_steps
    assert fast.emergency_saves == slow.emergency_saves
    assert fast.goodput == pytest.approx(slow.goodput, rel=1e-9)
