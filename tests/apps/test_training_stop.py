"""A planned stop of the training loop (``train(stop=...)``): the step it stops at is
durable when ``train`` returns, and the next process resumes from exactly that step."""

from __future__ import annotations

import time
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


def test_a_notice_ends_the_run_at_its_emergency_version_when_asked(tmp_path: Path) -> None:
    """``pcframe-run`` with a notice policy saved the emergency version on SIGTERM, then
    trained on past the notice's window as if nothing had happened (exit 0, no word of it).
    With ``stop_on_notice`` the run leaves at that step; without it (a supervised replay's
    child, which its kill ends) it trains on."""
    import pcframe.policies as P

    def run(directory: Path, stop_on_notice: bool):
        source = P.ManualNoticeSource(window=600.0)
        policy = P.NoticeDriven(FixedSteps(100), source)
        trigger = lambda step: source.trigger(time.monotonic()) if step == 12 else None  # noqa: E731
        return train(
            build("mlp", **WORKLOAD), 60, directory, policy, progress=trigger,
            stop_on_notice=stop_on_notice,
        )  # fmt: skip

    result, ckpt = run(tmp_path / "stops", True)
    assert result.noticed and result.stopped_at == 13 and len(result.losses) == 13
    assert committed_steps(ckpt) == [13]  # the emergency version, durable
    result, ckpt = run(tmp_path / "trains-on", False)
    assert not result.noticed and len(result.losses) == 60
