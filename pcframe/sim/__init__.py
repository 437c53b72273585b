"""Trace-driven simulator of checkpointed training on spot and on-demand VMs.

``simulate(trace, interval_policy, job, resource_policy, predictor, options)`` replays a
preemption/availability trace through the real ``pcframe.policies`` objects and returns a
:class:`SimResult` (goodput per wall second and per dollar, where the time went, cost,
deadline). See docs/simulator.md for the event model and its assumptions.
"""

from pcframe.errors import SimConfigError
from pcframe.sim.baselines import Oracle, best_fixed_interval, fixed_interval_grid
from pcframe.sim.calibrate import job_from_records, loop_save_costs
from pcframe.sim.capacity import Capacity
from pcframe.sim.result import BREAKDOWN, SimResult
from pcframe.sim.simulator import simulate
from pcframe.sim.spec import JobSpec, SimOptions
from pcframe.sim.synthetic import poisson_trace, steady_trace

__all__ = [
    "BREAKDOWN",
    "Capacity",
    "JobSpec",
    "Oracle",
    "SimConfigError",
    "SimOptions",
    "SimResult",
    "best_fixed_interval",
    "fixed_interval_grid",
    "job_from_records",
    "loop_save_costs",
    "poisson_trace",
    "simulate",
    "steady_trace",
]
