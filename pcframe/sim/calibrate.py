"""A ``JobSpec`` from what the engine measured, so the simulator predicts the real job.

The engine records every save (:class:`pcframe.checkpointer.SaveRecord`: the stall the
training thread saw, the time to durable) and the training child reports its restart cost
(process age at its first step after a restore). These are the simulator's inputs.

The engine's stall is the time inside ``save()``; the training loop pays a little more per
save (the calls around it, and an optimizer step that waits for the snapshot's copy),
about 1 ms on the replay validation's workload, which at a save every step or two is a
percent of goodput. Given the times the loop's steps ended, :func:`job_from_records` takes
the save's cost as the loop paid it (:func:`loop_save_costs`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from pcframe.errors import SimConfigError
from pcframe.sim.spec import JobSpec


def job_from_records(
    records: Iterable[Any],
    iteration_time: float,
    restart_cost: float,
    *,
    step_ends: Sequence[float] | None = None,
    first_step: int = 1,
    **overrides: Any,
) -> JobSpec:
    """Mean stall and time to durable of the committed saves in ``records``.

    Args:
        records: ``SaveRecord``-like objects with ``status``, ``step``, ``stall``,
            ``durable``, ``nbytes`` (``Checkpointer.records.values()``).
        iteration_time: seconds per training step without checkpointing (measured).
        restart_cost: seconds from process start to training again (measured).
        step_ends: when each step of the same run ended (``step_ends[i]``: step ``i + 1``,
            any clock in seconds, e.g. ``time.perf_counter()`` in ``train``'s ``on_step``).
            Given, the stall is the median cost per save as the loop paid it
            (:func:`loop_save_costs`), never below the engine's own figure; else, or where
            no step of the run is free of a save's cost, the engine's mean stall.
        first_step: the step ``step_ends[0]`` belongs to (a resumed run's first).
        **overrides: any other ``JobSpec`` field (``max_in_flight``, ``total_steps``, ...).
    """
    committed = [r for r in records if getattr(r, "status", "") == "committed"]
    if not committed:
        raise SimConfigError(
            "calibration needs at least one committed save; run the workload longer or "
            "checkpoint more often"
        )
    stall = statistics.fmean(r.stall for r in committed)
    if step_ends is not None:
        paid = loop_save_costs(step_ends, [r.step for r in committed], first_step=first_step)
        if paid:  # the loop pays at least the stall: a lower median is the steps' noise
            stall = max(stall, statistics.median(paid))
    values = {
        "iteration_time": iteration_time,
        "save_stall": stall,
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


def loop_save_costs(
    step_ends: Sequence[float], save_steps: Iterable[int], after: int = 2, first_step: int = 1
) -> list[float]:
    """What each save cost the training loop, in seconds.

    ``step_ends[i]`` is when step ``first_step + i`` ended (``first_step``: the first step
    a resumed run trained); a save of step ``s`` is taken at the end of step ``s``. Its cost
    is the time its step and the ``after`` steps that follow took beyond the median step of
    those no save touches (the optimizer step after a save waits for the snapshot's copy,
    so the cost spills over). A save's steps end before the next save's, so saves closer
    than that share their steps out and the costs still add up to what the loop lost.
    Saves whose steps are not all measured are left out; empty when no step is untouched.
    """
    saves = sorted(set(save_steps))
    last = first_step + len(step_ends) - 1
    took = {
        k: step_ends[k - first_step] - step_ends[k - first_step - 1]
        for k in range(first_step + 1, last + 1)
    }
    touched = {s + j for s in saves for j in range(after + 1)}
    quiet = [d for k, d in took.items() if k not in touched]
    if not quiet:
        return []
    typical = statistics.median(quiet)
    out = []
    for i, s in enumerate(saves):
        end = s + after if i + 1 == len(saves) else min(s + after, saves[i + 1] - 1)
        if all(k in took for k in range(s, end + 1)):
            out.append(sum(took[k] - typical for k in range(s, end + 1)))
    return out
