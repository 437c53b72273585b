"""The supervisor really SIGKILLs the training process, restarts it, and it resumes exactly."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from pcframe.apps.preemption import (
    ChildSpec,
    KillClock,
    Life,
    SupervisedRun,
    Supervisor,
    SupervisorError,
    compare_finals,
)
from pcframe.store.directory import CheckpointDir

EVERY = 10
STEPS = 600
# The GPT workload, small: about 10 ms a step here, so a life of the child is a few seconds.
GPT = {"vocab": 256, "context": 16, "width": 64, "layers": 2, "heads": 2, "samples": 256}


def spec(tmp_path, name: str) -> ChildSpec:
    return ChildSpec(
        directory=str(tmp_path / name),
        steps=STEPS,
        workload="gpt",
        workload_args=GPT,
        engine={"chunk_bytes": 65536},
        policy={"_target_": "pcframe.policies.FixedSteps", "every": EVERY},
        threads=1,
        final=str(tmp_path / f"{name}.safetensors"),
    )


# With the campaigns: the smoke experiment (tests/apps/test_run_output.py) kills twice and
# checks the bit-identical resume through this supervisor in the default run.
@pytest.mark.campaign
def test_sigkill_restart_resume_matches_an_uninterrupted_run(tmp_path, child_env):
    reference = Supervisor(spec(tmp_path, "reference"), env=child_env).run()
    assert reference.kills == 0 and len(reference.lives) == 1
    # Start-up (interpreter, torch import) is most of a life on a loaded 2-core machine and
    # varies with the load, so the kills are on the training clock: each life trains 40 % of
    # the reference's training and is killed, two lives cover at most 80 % of the work, the
    # third has to finish it, and the kill times scale with this machine's speed.
    training = reference.lives[0].training_seconds
    assert training > 0.5, "the workload got too fast for this test: raise STEPS"
    kills = [0.4 * training, 0.8 * training]
    logs = tmp_path / "logs"
    run = Supervisor(
        spec(tmp_path, "killed"), kills, clock=KillClock.TRAINING, env=child_env, log_dir=logs
    )
    result = run.run()

    assert result.kills == 2 and len(result.lives) == 3
    assert [life.returncode for life in result.lives] == [-signal.SIGKILL, -signal.SIGKILL, 0]
    assert [life.killed for life in result.lives] == [True, True, False]
    # At least one restart resumed from a checkpoint (not from scratch), at a save step.
    resumed = [life.start_step for life in result.lives[1:] if life.start_step]
    assert resumed and all(step % EVERY == 0 for step in resumed)
    # Work since the newest durable checkpoint is lost, and only that.
    assert 0 <= result.lost_steps <= result.kills * 3 * EVERY
    assert abs(result.executed_steps - result.lost_steps - STEPS) <= result.kills
    restarts = result.restart_seconds
    assert restarts and all(0 < r < result.wall for r in restarts)
    assert result.goodput < STEPS / training  # preemptions cost something
    # The final model and optimizer state are bit-identical to the uninterrupted run's.
    assert compare_finals(tmp_path / "reference.safetensors", tmp_path / "killed.safetensors") == []
    assert CheckpointDir(tmp_path / "killed").committed_versions()
    assert (tmp_path / "logs" / "child-0.stderr").exists()


# With the campaigns (pytest -m campaign): 34 s of the default run on 2 cores.
@pytest.mark.campaign
def test_the_training_clock_stands_still_while_a_process_starts(tmp_path, child_env):
    # On the job clock a kill 0.3 s after the spawn lands while the child is still importing
    # torch; on the training clock the same time means 0.3 s after each first step.
    kills = [0.3, 0.6]
    job = Supervisor(spec(tmp_path, "job"), kills[:1], env=child_env).run()
    assert job.lives[0].killed and job.lives[0].first_step_at is None
    run = Supervisor(spec(tmp_path, "training"), kills, clock=KillClock.TRAINING, env=child_env)
    lives = run.run().lives
    assert [life.killed for life in lives] == [True, True, False]
    trained = 0.0
    for life, kill in zip(lives, kills, strict=False):  # killed when training had taken 0.3, 0.6 s
        assert life.first_step_at is not None, life
        trained += life.training_seconds
        assert kill - 1e-6 <= trained < kill + 1.0, (life, trained)


@pytest.mark.slow
def test_a_child_that_fails_by_itself_is_an_error_with_its_stderr(tmp_path, child_env):
    broken = dataclasses.replace(spec(tmp_path, "broken"), workload_args={"no_such_arg": 1})
    with pytest.raises(SupervisorError, match="exited with code 1 without being killed") as info:
        Supervisor(broken, [60.0], env=child_env, log_dir=tmp_path / "logs").run()
    assert "no_such_arg" in str(info.value)


def test_timeout_kills_the_child_and_says_which_key(tmp_path, child_env):
    with pytest.raises(SupervisorError, match=r"failure\.timeout=0\.5"):
        Supervisor(spec(tmp_path, "slow"), env=child_env, timeout=0.5).run()


def test_a_kill_during_a_restart_is_not_one_long_restart() -> None:
    """``whole_restarts`` (the replay validation's restart samples): from each kill to the
    next process's first step, only where that process trained one. A process killed before
    its first step (the harsh trace kills every 6 s) would otherwise give a sample spanning
    two restarts (and one more for itself), which doubled the replay's "restart" there."""
    lives = [
        Life(0, 0.0, first_step_at=1.0, ended=10.0, killed=True),  # restart begins at 10
        Life(1, 10.0, first_step_at=None, ended=11.5, killed=True),  # killed while restoring
        Life(2, 11.5, first_step_at=14.0, ended=30.0, killed=True),  # 2.5 s after that kill
        Life(3, 30.0, first_step_at=32.0, ended=40.0, killed=False),
    ]
    run = SupervisedRun(steps=100, lives=lives, wall=40.0, scheduled_kills=3)
    assert run.restart_seconds == [4.0, 2.5, 2.0]  # the first spans both restarts
    assert run.whole_restarts == [2.5, 2.0]
