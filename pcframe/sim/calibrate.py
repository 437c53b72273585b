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

import dataclasses
import itertools
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from pcframe.errors import SimConfigError
from pcframe.runtime.checks import finite_number, whole_number
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

    Raises:
        SimConfigError: no committed save; a record that is not a save record or whose
            figures are not finite numbers >= 0; ``step_ends`` out of order, not finite, of
            another run (no committed save among its steps) or in another unit than
            ``iteration_time``; an unknown override.
    """
    records = list(records)
    for i, r in enumerate(records):
        if not hasattr(r, "status"):
            raise SimConfigError(
                f"records[{i}] is a {type(r).__name__}, not a save record: give the engine's "
                "records (Checkpointer.records.values())"
            )
    committed = [r for r in records if getattr(r, "status", "") == "committed"]
    if not committed:
        raise SimConfigError(
            "calibration needs at least one committed save; run the workload longer or "
            "checkpoint more often"
        )
    stall = statistics.fmean(_figures(committed, "stall"))
    if step_ends is not None:
        steps = [_step(r.step, "records[].step") for r in committed]
        paid = loop_save_costs(step_ends, steps, first_step=first_step)
        _check_step_ends_fit(step_ends, steps, first_step, iteration_time)
        if paid:  # the loop pays at least the stall: a lower median is the steps' noise
            stall = max(stall, statistics.median(paid))
    values = {
        "iteration_time": iteration_time,
        "save_stall": stall,
        "save_duration": statistics.fmean(_figures(committed, "durable")),
        "restart_cost": restart_cost,
        "checkpoint_bytes": int(statistics.fmean(_figures(committed, "nbytes"))),
        **overrides,
    }
    if "save_duration" not in overrides:
        # Measured separately, the mean time to durable can fall under the mean stall only
        # by noise: a save is durable after its stall ends.
        values["save_duration"] = max(values["save_duration"], values["save_stall"])
    known = {f.name for f in dataclasses.fields(JobSpec)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise SimConfigError(f"unknown JobSpec key(s) {unknown}; known: {', '.join(sorted(known))}")
    return JobSpec(**values)


def _figures(records: list[Any], key: str) -> list[float]:
    """Each record's ``key`` (seconds, or bytes) as a finite number >= 0 (else one line
    naming it)."""
    out = []
    for r in records:
        value = getattr(r, key, None)
        if not (finite_number(value) and value >= 0):
            raise SimConfigError(
                f"record of step {getattr(r, 'step', '?')}: {key}={value!r} is invalid: a "
                "committed save's figure is a finite number >= 0 (the engine's records are)"
            )
        out.append(float(value))
    return out


def _step(value: Any, what: str) -> int:
    if not whole_number(value):
        raise SimConfigError(f"{what}={value!r} is invalid: steps are integers")
    return int(value)


def _check_step_ends_fit(
    step_ends: Sequence[float], saves: list[int], first_step: int, iteration_time: float
) -> None:
    """``step_ends`` must be of the same run as the saves, in seconds: a save among its
    steps, and steps about ``iteration_time`` apart (else the calibration would silently
    fall back to the engine's figure, or take milliseconds for seconds)."""
    last = first_step + len(step_ends) - 1
    if not any(first_step <= s <= last for s in saves):
        raise SimConfigError(
            f"step_ends covers steps {first_step}..{last} but the committed saves are at "
            f"steps {min(saves)}..{max(saves)}: give first_step= the step step_ends[0] "
            "ended (a resumed run's first) and the times of the same run"
        )
    if len(step_ends) >= 2:
        typical = statistics.median(b - a for a, b in itertools.pairwise(step_ends))
        if not iteration_time / 20 <= typical <= 20 * iteration_time:
            raise SimConfigError(
                f"step_ends: steps end {typical:.3g} apart but iteration_time="
                f"{iteration_time:.3g} s: give both in seconds, of the same run"
            )


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
    step_ends = _checked_ends(step_ends)
    if not whole_number(after) or after < 0:
        raise SimConfigError(
            f"after={after!r} is invalid: give the steps a save's cost spills into, >= 0 "
            "(2: the optimizer step after it waits for the snapshot)"
        )
    after = min(int(after), len(step_ends))  # no window is longer than the run
    first_step = _step(first_step, "first_step")
    saves = sorted({_step(s, "save_steps[]") for s in save_steps})
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


def _checked_ends(step_ends: Sequence[float]) -> list[float]:
    """The step end times as floats, finite and in order (else one line naming the first
    that is not: reversed or shuffled times gave negative costs, silently)."""
    out: list[float] = []
    for i, value in enumerate(step_ends):
        if not finite_number(value) or (out and value < out[-1]):
            raise SimConfigError(
                f"step_ends[{i}]={value!r} is invalid: give the times each step ended, "
                "finite and in order (e.g. time.perf_counter() after each step)"
            )
        out.append(float(value))
    return out
