"""Spot, on-demand, hybrid and Uniform Progress driven over traces, with their bills."""

from __future__ import annotations

import numpy as np
import pytest

import pcframe.policies as P
from pcframe.policies.traces import Trace
from pcframe.sim import JobSpec, SimOptions, simulate, steady_trace
from tests.sim.helpers import V100, shipped

JOB = JobSpec(iteration_time=1.0, save_stall=2.0, save_duration=30.0, restart_cost=300.0)


def test_on_demand_is_never_preempted_and_pays_the_on_demand_price() -> None:
    trace = shipped(V100)
    window = SimOptions(duration=5 * 86400.0)
    r = simulate(trace, P.Daly(mtbf=3600.0), JOB, P.OnDemandOnly(), options=window)
    assert r.preemptions == 0 and r.time["waiting"] == 0.0 and r.starts == 1
    assert r.spot_cost == 0.0
    assert r.on_demand_cost == pytest.approx(trace.on_demand_price * 5 * 24, rel=1e-9)
    spot = simulate(trace, P.Daly(mtbf=3600.0), JOB, P.SpotOnly(), options=window)
    assert spot.preemptions > 0 and spot.goodput < r.goodput
    assert spot.dollars_per_kstep < r.dollars_per_kstep  # spot is cheaper per useful step


def test_spot_bill_follows_the_trace_price_tick_by_tick() -> None:
    up = np.ones(120, dtype=np.int64)
    price = np.where(np.arange(120) < 60, 1.0, 3.0)
    trace = Trace("two-prices", "test", 60.0, 1, up, spot_price=price, on_demand_price=5.0)
    r = simulate(trace, P.FixedSteps(100), JobSpec(restart_cost=0.0, vms=2))
    assert r.spot_cost == pytest.approx(2 * (1.0 * 1.0 + 3.0 * 1.0))  # 2 VMs, 1 h at each
    assert r.spot_vm_seconds == pytest.approx(2 * 7200.0)


def _outage_trace() -> Trace:
    """Spot up for 2 h, then gone for 10 h, then back: a deadline needs on-demand."""
    up = np.ones(24 * 60, dtype=np.int64)
    up[120:720] = 0
    return Trace(
        "outage", "test", 60.0, 1, up, spot_price=np.full(up.size, 1.0), on_demand_price=3.0
    )


def test_uniform_progress_meets_a_deadline_that_spot_alone_misses() -> None:
    trace = _outage_trace()
    job = JobSpec(
        iteration_time=1.0,
        save_stall=1.0,
        save_duration=10.0,
        restart_cost=120.0,
        total_steps=8 * 3600,
        deadline=12 * 3600.0,
    )
    spot = simulate(trace, P.Daly(mtbf=7200.0), job, P.SpotOnly())
    assert spot.finished and spot.deadline_met is False
    up = simulate(trace, P.Daly(mtbf=7200.0), job, P.UniformProgress(changeover=120.0))
    assert up.finished and up.deadline_met is True
    assert up.on_demand_vm_seconds > 0 and up.starts >= 2  # spot first, then on-demand
    on_demand = simulate(trace, P.Daly(mtbf=7200.0), job, P.OnDemandOnly())
    assert on_demand.deadline_met and up.cost < on_demand.cost  # cheaper than all on-demand


def test_hybrid_moves_to_on_demand_when_predicted_availability_is_low() -> None:
    trace = _outage_trace()
    job = JobSpec(iteration_time=1.0, save_stall=1.0, save_duration=10.0, restart_cost=120.0)
    r = simulate(
        trace,
        P.Daly(mtbf=7200.0),
        job,
        P.HybridAvailability(low=0.5, high=0.8, max_spot_vms=4, min_dwell=0.0),
        P.EwmaRate(halflife=1800.0),
        SimOptions(resource_interval=600.0),
    )
    assert r.on_demand_vm_seconds > 0 and r.spot_vm_seconds > 0
    assert r.changeovers >= 2  # to on-demand in the outage, back to (more) spot after
    assert r.time["waiting"] < 2 * 3600.0  # it did not sit out the 10 h outage
    # Scaling out: more VM-seconds than seconds with a VM means several VMs at times.
    running = r.wall_seconds - r.time["waiting"]
    assert r.spot_vm_seconds + r.on_demand_vm_seconds > 1.5 * running
    spot = simulate(trace, P.Daly(mtbf=7200.0), job, P.SpotOnly())
    assert r.useful_steps > spot.useful_steps


def test_more_vms_run_faster_by_the_scaling_efficiency() -> None:
    trace = steady_trace(6.0)
    job = JobSpec(iteration_time=1.0, save_stall=0.0, save_duration=0.0, restart_cost=0.0)
    one = simulate(trace, P.NoticeDriven(None), job, P.SpotOnly(1))
    four = simulate(
        trace,
        P.NoticeDriven(None),
        JobSpec(restart_cost=0.0, scaling_efficiency=0.9),
        P.SpotOnly(4),
    )
    assert four.useful_steps / one.useful_steps == pytest.approx(4 * 0.9**2, rel=1e-3)
    assert four.spot_cost == pytest.approx(4 * one.spot_cost)
