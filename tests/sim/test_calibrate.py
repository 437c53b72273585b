"""A JobSpec from the real engine's measurements, and the simulator's view of that job."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

import pcframe.policies as P
from pcframe.apps.training import train
from pcframe.apps.workloads import build
from pcframe.config import EngineConfig
from pcframe.sim import SimConfigError, job_from_records, loop_save_costs, simulate, steady_trace


def test_calibration_takes_the_engines_own_numbers(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    workload = build("mlp", hidden=64, layers=2, samples=512, batch_size=32)
    result, ckpt = train(
        workload, 60, tmp_path / "ckpt", P.FixedSteps(10), EngineConfig(max_in_flight=2)
    )
    committed = [r for r in ckpt.records.values() if r.status == "committed"]
    assert len(committed) == 6
    step = result.seconds / result.steps
    job = job_from_records(ckpt.records.values(), step, restart_cost=3.0, max_in_flight=2)
    assert job.save_stall == pytest.approx(statistics.fmean(r.stall for r in committed))
    assert job.save_duration >= job.save_stall > 0
    assert job.checkpoint_bytes == committed[0].nbytes > 0
    # The simulator's failure-free prediction for that job: one cycle is 10 steps + a stall.
    r = simulate(steady_trace(1.0), P.FixedSteps(10), job)
    cycle = max(10 * step + job.save_stall, job.save_duration / 2)
    assert r.goodput == pytest.approx(10 / cycle, rel=0.01)


def test_calibration_without_a_committed_save_says_what_to_do() -> None:
    with pytest.raises(SimConfigError, match="at least one committed save"):
        job_from_records([], 0.1, 1.0)


class _Record:
    def __init__(self, step: int, stall: float = 0.01, durable: float = 0.05, **kw) -> None:
        self.status, self.step, self.stall, self.durable, self.nbytes = (
            "committed",
            step,
            stall,
            durable,
            1000,
        )
        self.__dict__.update(kw)


@pytest.mark.parametrize(
    ("step_ends", "kwargs", "words"),
    [
        # Reversed times gave negative costs, and the engine's figure was used silently.
        ([0.3, 0.2, 0.1], {}, ["step_ends[1]=0.2", "in order"]),
        ([0.1, float("nan"), 0.3], {}, ["step_ends[1]=nan", "finite"]),
        ([0.1, 0.2, 0.3], {"after": -1}, ["after=-1", ">= 0"]),
        ([0.1, 0.2, 0.3], {"after": 1.5}, ["after=1.5"]),
        ([0.1, 0.2, 0.3], {"first_step": 1.5}, ["first_step=1.5", "integers"]),
    ],
)
def test_the_loops_step_times_are_checked(step_ends: list, kwargs: dict, words: list) -> None:
    with pytest.raises(SimConfigError) as err:
        loop_save_costs(step_ends, [2], **kwargs)
    for word in words:
        assert word in str(err.value)


def test_a_spill_window_longer_than_the_run_is_the_run() -> None:
    """``after=10**9`` built a set of 1e9 steps per save (it hung); one step's time given
    to ``job_from_records`` (which does not take ``after``) was refused about ``after``."""
    ends = [0.1 * (i + 1) for i in range(10)]
    assert loop_save_costs(ends, [2], after=10**9) == loop_save_costs(ends, [2], after=10)
    job = job_from_records([_Record(1)], 0.1, 1.0, step_ends=[0.1])
    assert job.save_stall == pytest.approx(0.01)  # nothing measured: the engine's figure


def test_step_times_of_another_run_or_unit_are_refused_not_ignored() -> None:
    """A resumed run's times given without ``first_step`` cover none of its saves, and times
    in milliseconds make a step 1000x the iteration time: both fell back (or scaled the
    stall 1000x) silently."""
    ends = [0.1 * (i + 1) for i in range(100)]
    resumed = [_Record(step) for step in range(1010, 1060, 10)]
    with pytest.raises(SimConfigError, match=r"covers steps 1\.\.100 .* steps 1010\.\.1050"):
        job_from_records(resumed, 0.1, 1.0, step_ends=ends)
    assert job_from_records(resumed, 0.1, 1.0, step_ends=ends, first_step=1001).save_stall > 0
    in_ms = [1000 * t for t in ends]
    saves = [_Record(step) for step in range(10, 100, 10)]
    with pytest.raises(SimConfigError, match="give both in seconds"):
        job_from_records(saves, 0.1, 1.0, step_ends=in_ms)


@pytest.mark.parametrize(
    ("record", "words"),
    [
        (_Record(5, nbytes=float("nan")), ["nbytes=nan", "step 5"]),
        (_Record(5, stall=None), ["stall=None"]),
        ({"status": "committed", "step": 5}, ["records[0] is a dict", "Checkpointer.records"]),
    ],
)
def test_bad_records_are_named(record, words: list) -> None:
    with pytest.raises(SimConfigError) as err:
        job_from_records([record], 0.1, 1.0)
    for word in words:
        assert word in str(err.value)
    with pytest.raises(SimConfigError, match=r"unknown JobSpec key\(s\) \['stal'\]"):
        job_from_records([_Record(5)], 0.1, 1.0, stal=3)


def test_a_saves_cost_is_what_the_training_loop_lost_to_it() -> None:
    """The loop's cost of a save: the extra time of its step and the steps after it (the
    optimizer step waits for the snapshot copy) over a step no save touches. The engine's
    own stall figure leaves out the calls around it; a simulator fed that figure for a
    policy saving every few steps ran ahead of the real loop."""
    every, typical = 5, 0.100
    ends, t = [], 0.0
    for step in range(1, 101):
        t += typical + 0.0004 * (step % 3)  # jitter that the median sees through
        if step % every == 0:
            t += 0.0040  # the save in its own step
        elif step % every == 1 and step > 1:
            t += 0.0020  # the optimizer step after it waits for the copy
        elif step % every == 2 and step > 2:
            t += 0.0010  # and the one after that, a little
        ends.append(t)
    costs = loop_save_costs(ends, range(every, len(ends) + 1, every))
    assert len(costs) == 19  # every save whose following steps are measured
    assert statistics.median(costs) == pytest.approx(0.0070, abs=0.0004)
    assert loop_save_costs(ends[:3], [every]) == []  # no save measured
    # A resumed run: the same steps numbered from 101 on.
    resumed = loop_save_costs(ends, range(100 + every, 201, every), first_step=101)
    assert resumed == pytest.approx(costs)


def test_saves_closer_than_their_spill_share_their_steps_out() -> None:
    """Saves every step or two: each save's steps end before the next save's, so the costs
    add up to what the loop lost (before, overlapping windows counted each spill twice)."""
    typical, cost = 0.100, 0.003
    ends, t = [], 0.0
    saves = list(range(21, 61, 2))  # 20 quiet steps first, then a save every 2 steps
    for step in range(1, 81):
        t += typical + (cost if step in saves else 0.0)
        ends.append(t)
    got = loop_save_costs(ends, saves)
    assert statistics.median(got) == pytest.approx(cost, abs=1e-9)
    assert sum(got) == pytest.approx(cost * len(got), abs=1e-9)


def test_calibration_with_the_loops_step_times_takes_the_cost_the_loop_paid(tmp_path) -> None:
    """Given when each step ended, the stall is what a save cost the loop (its step and
    the two after it over a quiet step), which holds the engine's own figure: a save whose
    loop around it is slower (here a 50 ms pause the loop takes at every save) is
    calibrated with that pause, the engine's figure without it."""
    import time

    torch.set_num_threads(1)
    workload = build("mlp", hidden=64, layers=2, samples=512, batch_size=32)
    ends: list[float] = []

    def on_step(step: int) -> None:
        if step % 10 == 0:
            time.sleep(0.050)  # the loop's own work around a save, outside save()
        ends.append(time.perf_counter())

    result, ckpt = train(workload, 80, tmp_path / "ckpt", P.FixedSteps(10), EngineConfig(), on_step)
    step = result.seconds / result.steps
    engine = job_from_records(ckpt.records.values(), step, restart_cost=1.0)
    loop = job_from_records(ckpt.records.values(), step, restart_cost=1.0, step_ends=ends)
    # The engine does not see the loop's pause (its mean stall stays well under it even
    # on a busy machine: 5-13 ms measured beside 2-3 busy loops); the loop's figure has it.
    assert engine.save_stall < 0.040
    assert loop.save_stall >= 0.045 and loop.save_stall >= engine.save_stall
    assert loop.save_duration >= loop.save_stall
