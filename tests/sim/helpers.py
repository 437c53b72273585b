"""Shared builders for the simulator tests: real traces, fresh shipped policies."""

from __future__ import annotations

from collections.abc import Callable

import pcframe.policies as P
from pcframe.policies.traces import Trace, load_trace, shared_traces_dir
from pcframe.sim import JobSpec, Oracle

JOB = JobSpec(iteration_time=1.0, save_stall=2.0, save_duration=30.0, restart_cost=120.0, vms=None)


def shipped(relative: str) -> Trace:
    root = shared_traces_dir()
    assert root is not None, "the shipped traces (experiments/traces) are missing"
    return load_trace(root / relative)


V100 = "skynomad/aws-v100-availability-2023/us-east-1c_v100_1.csv"
H100 = "skynomad/gcp-h100-16-2025/us-east4-a_h100_16.json"
NODES = "skynomad/aws-v100-4node-preemption-2023/us-east-1f_v100_1.json"
BAMBOO = "bamboo/p3-trace.csv"


def policies(mtbf: float) -> dict[str, Callable[[], P.IntervalPolicy]]:
    """Every shipped interval policy, fresh from a factory."""
    return {
        "fixed_steps_7": lambda: P.FixedSteps(7),
        "fixed_steps_300": lambda: P.FixedSteps(300),
        "fixed_time_600": lambda: P.FixedTime(600.0),
        "young": lambda: P.Young(mtbf=mtbf),
        "daly": lambda: P.Daly(mtbf=mtbf),
        "daly_series": lambda: P.Daly(mtbf=mtbf, form="series"),
        "overhead_budget": lambda: P.OverheadBudget(0.05),
        "checkfreq": lambda: P.CheckFreq(),
        "preemption_aware": lambda: P.PreemptionAware(P.GammaPoissonRate(mtbf)),
        "notice_daly": lambda: P.NoticeDriven(P.Daly(mtbf=mtbf), margin=2.0),
        "notice_only": lambda: P.NoticeDriven(None, save_time_prior=30.0),
        "oracle": Oracle,
    }
