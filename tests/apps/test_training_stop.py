"""A planned stop of the training loop (``train(stop=...)``): the step it stops at is
durable when ``train`` returns, and the next process resumes from exactly that step."""

from __future__ import annotations

from pathlib import Path

from pcframe.apps.training import train
from pcframe.apps.workloads import build
from pcframe.policies import FixedSteps
from pcframe.save.status import SaveStatus

WORKLOAD = {"hidden": 32, "layers": 2, "samples": 256}


def committed_steps(checkpointer) -> list[int]:
    return sorted(r.step for r in checkpointer.records.values() if r.status == SaveStatus.COMMITTED)


def test_a_planned_stop_saves_its_step_and_the_next_process_resumes_there(
    tmp_path: Path,
) -> None:
    result, ckpt = train(
        build("mlp", **WORKLOAD), 100, tmp_path, FixedSteps(5), stop=lambda step: step == 7
    )
    assert result.stopped_at == 7
    assert len(result.losses) == 7  # nothing trained after the stop
    assert committed_steps(ckpt) == [5, 7]  # the policy's save, then the stop's
    again, _ = train(build("mlp", **WORKLOAD), 9, tmp_path, FixedSteps(5))
    assert again.start_step == 7 and len(again.losses) == 2


def test_a_stop_at_a_step_the_policy_saved_adds_no_version(tmp_path: Path) -> None:
    result, ckpt = train(
        build("mlp", **WORKLOAD), 100, tmp_path, FixedSteps(5), stop=lambda step: step == 10
    )
    assert result.stopped_at == 10
    assert committed_steps(ckpt) == [5, 10]
    assert len(ckpt.records) == 2


def test_a_stop_without_a_checkpointer_only_ends_the_loop() -> None:
    result, ckpt = train(build("mlp", **WORKLOAD), 100, stop=lambda step: step == 3)
    assert ckpt is None and result.stopped_at == 3 and len(result.losses) == 3


def test_without_a_stop_the_run_goes_to_its_last_step(tmp_path: Path) -> None:
    result, _ = train(build("mlp", **WORKLOAD), 12, tmp_path, FixedSteps(5))
    assert result.stopped_at is None and len(result.losses) == 12
