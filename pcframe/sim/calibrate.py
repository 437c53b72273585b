"""A ``JobSpec`` from what the engine measured, so the simulator predicts the real job.

The engine records every save (:class:`pcframe.checkpointer.SaveRecord`: the stall the
training thread saw, the time to durable) and the training child reports its restart cost
(process age at its first step after a restore). These are the simulator's inputs.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from pcframe.errors import SimConfigError
from pcframe.sim.spec import JobSpec


def job_from_records(
    records: Iterable[Any],
    iteration_time: float,
    restart_cost: float,
    **overrides: Any,
) -> JobSpec:
    """Mean stall and time to durable of the committed saves in ``records``.

    Args:
        records: ``SaveRecord``-like objects with ``status``, ``stall``, ``durable``,
            ``nbytes`` (``Checkpointer.records.values()``).
        iteration_time: seconds per training step without checkpointing (measured).
        restart_cost: seconds from process start to training again (measured).
        **overrides: any other ``JobSpec`` field (``max_in_flight``, ``total_steps``, ...).
    """
    committed = [r for r in records if getattr(r, "status", "") == "committed"]
    if not committed:
        raise SimConfigError(
            "calibration needs at least one committed save; run the workload longer or "
            "checkpoint more often"
        )
    values = {
        "iteration_time": iteration_time,
        "save_stall": statistics.fmean(r.stall for r in committed),
        "save_duration": statistics.fmean(r.durable for r in committed),
        "restart_cost": restart_cost,
        "checkpoint_bytes": int(statistics.fmean(r.nbytes for r in committed)),
        **overrides,
    }
    if "save_duration" not in overrides:
        # Measured separately, the mean time to durable can fall under the mean stall only
        # by noise: a save is durable after its stall ends.
        values["save_duration"] = max(values["save_duration"], values["save_stall"])
    return JobSpec(**values)
