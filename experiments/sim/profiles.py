"""The job profiles of the simulator experiments, read from the shipped Hydra presets
(``conf/sim/job/*.yaml``) so the experiments and ``pcframe-sim`` use the same numbers."""

from __future__ import annotations

import dataclasses

from hydra import compose, initialize_config_module

from pcframe.policies.traces import Trace
from pcframe.sim import JobSpec
from pcframe.sim.app_config import build_job, register_schemas


def preset(name: str) -> JobSpec:
    register_schemas()
    with initialize_config_module("pcframe.conf", version_base="1.3"):
        cfg = compose("sim", overrides=[f"sim/job={name}"])
    return build_job(cfg.sim.job)


def job_for(trace: Trace, regime: str = "async") -> JobSpec:
    """The H100 preset for the GCP H100 zones, the V100 preset for every other trace.

    ``regime``: ``async`` (pcframe: short stall, N=2 in flight) or ``sync`` (a blocking
    ``torch.save``: the stall is the whole time to durable, one at a time).
    """
    job = preset("h100_llm" if "h100" in trace.source else "v100_llm")
    if regime == "sync":
        job = dataclasses.replace(job, save_stall=job.save_duration, max_in_flight=1)
    elif regime != "async":
        raise ValueError(f"regime={regime!r}: use 'async' or 'sync'")
    return job
