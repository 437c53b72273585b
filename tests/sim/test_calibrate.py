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
from pcframe.sim import SimConfigError, job_from_records, simulate, steady_trace


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
