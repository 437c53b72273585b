"""The fast-forward against the hinted path on random jobs: the same saves, steps and times.

Each case draws a job (step time, stall, time to durable, slots, serial or parallel writes,
restart cost, notice window, VMs), a Poisson trace and a shipped policy other than
``PreemptionAware`` (whose drift docs/simulator.md bounds instead). The draws found four
causes of difference, each fixed: a policy at a rounding edge (Daly at its concurrency floor
over serial writes), a learned cost still moving inside a stretch (CheckFreq's k; a policy
smoothing more slowly than the engine), and a restart from a save made inside a stretch,
which got the stretch's starting policy state.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

import pcframe.policies as P
from pcframe.sim import JobSpec, SimOptions, poisson_trace, simulate


def _case(rng: random.Random) -> tuple:
    job = JobSpec(
        iteration_time=rng.choice([0.3, 1.0, 1.7, 3.5, 7.0]),
        save_stall=rng.choice([0.0, 0.05, 0.1, 0.5, 2.0]),
        save_duration=rng.choice([2.0, 5.1, 12.3, 40.0]),
        max_in_flight=rng.choice([1, 2, 4]),
        persist=rng.choice(["serial", "parallel"]),
        restart_cost=rng.choice([0.0, 30.0, 120.0]),
        notice_window=rng.choice([0.0, 0.0, 30.0]),
        survivor_tier_duration=rng.choice([None, 3.0]),
        vms=1,
    )
    mtbf = rng.choice([600.0, 1800.0, 7200.0])
    trace = poisson_trace(mtbf=mtbf, hours=8.0, seed=rng.randrange(1000))
    planned = rng.choice([1.0, 60.0, mtbf])
    every = rng.choice([30.0, 61.3, 600.0])
    alpha = rng.choice([0.1, 0.25])  # a policy smoothing more slowly than the engine
    makers = {
        "daly": lambda: P.Daly(mtbf=planned, alpha=alpha),
        "daly_duration": lambda: P.Daly(mtbf=planned, cost="duration"),
        "young": lambda: P.Young(mtbf=planned, alpha=alpha),
        "fixed_time": lambda: P.FixedTime(every),
        "checkfreq": P.CheckFreq,
        "overhead_budget": lambda: P.OverheadBudget(0.05),
        "notice_daly": lambda: P.NoticeDriven(P.Daly(mtbf=planned), margin=2.0),
    }
    name = rng.choice(sorted(makers))
    options = SimOptions(policy_state=rng.choice(["checkpoint", "process"]))
    return name, makers[name], job, trace, options


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.slow
def test_the_fast_forward_changes_nothing_on_random_jobs(seed: int) -> None:
    rng = random.Random(seed)
    stretches = 0
    for case in range(30):
        name, make, job, trace, options = _case(rng)
        fast = simulate(trace, make(), job, options=options)
        hinted = simulate(
            trace, make(), job, options=dataclasses.replace(options, fast_forward=False)
        )
        where = f"seed {seed} case {case}: {name}, {job}"
        assert (fast.useful_steps, fast.saves, fast.saves_lost) == (
            hinted.useful_steps,
            hinted.saves,
            hinted.saves_lost,
        ), where
        assert fast.time == pytest.approx(hinted.time, rel=1e-9, abs=1e-6), where
        stretches += fast.fast_forwards
    assert stretches > 30  # the draws do exercise the fast-forward
