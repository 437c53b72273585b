"""Kill schedules fitted to the machine: derived from the reference run, checked, or refused."""

from __future__ import annotations

import dataclasses

import pytest

from pcframe.apps.preemption import KillClock, kill_times, poisson_times
from pcframe.apps.preemption.plan import Measured, check_plan, estimate, plan
from pcframe.errors import ConfigError
from tests.apps.conftest import compose, run_module


def failure(tmp_path, *overrides: str):
    return compose("run", *overrides, directory=tmp_path).failure


# A loaded machine (the issue's): 750 ms a step, 5 s to start; and a fast one: 30 ms, 3 s.
SLOW = Measured(steps=300, startup=5.0, step_seconds=0.75, commits=3, durable=0.5, wall=230.0)
FAST = Measured(steps=300, startup=3.0, step_seconds=0.03, commits=3, durable=0.05, wall=12.0)


@pytest.mark.parametrize("machine", [SLOW, FAST], ids=["loaded", "fast"])
def test_the_readme_poisson_launch_fits_any_machine(tmp_path, machine):
    # pcframe-run workload=gpt failure=poisson: FixedSteps(100) by default, mtbf derived
    f = failure(tmp_path, "workload=gpt", "failure=poisson")
    result = plan(f, machine, every=100, every_pinned=False)
    gap = machine.training / f.target_kills  # training seconds: start-ups do not count
    assert result.mean_gap == pytest.approx(gap) and result.clock is KillClock.TRAINING
    assert result.times == pytest.approx(poisson_times(gap, f.max_kills, f.seed))
    # the interval comes down so that a process lives through several checkpoints
    assert result.every is not None and result.every < 100
    assert result.every * machine.step_seconds * 4 <= gap
    assert result.estimate.landed >= 1 and result.estimate.commits_before_kills >= 1
    check_plan(result, f, machine, "FixedSteps", 100)  # accepted


@pytest.mark.parametrize("machine", [SLOW, FAST], ids=["loaded", "fast"])
@pytest.mark.parametrize("experiment", ["smoke", "pccheck_trace", "gpt_poisson"])
def test_every_shipped_experiment_fits_any_machine(tmp_path, machine, experiment):
    cfg = compose("run", f"experiment={experiment}", directory=tmp_path)
    steps = cfg.steps
    m = Measured(steps, machine.startup, machine.step_seconds * 300 / steps, steps // 10, 0.1, 0)
    m.wall = m.startup + m.training
    result = plan(cfg.failure, m, every=cfg.policy.interval.every, every_pinned=True)
    assert result.estimate.landed >= 2, result
    check_plan(result, cfg.failure, m, "FixedSteps", cfg.policy.interval.every)


def test_the_old_fixed_schedule_is_refused_with_the_reason(tmp_path):
    # The fast machine: first kill at 55.8 s, the run over at about 12 s.
    f = failure(tmp_path, "failure=poisson", "failure.mtbf=30")
    result = plan(f, FAST, every=100, every_pinned=True)
    assert result.times[0] == pytest.approx(55.8, abs=0.1) and result.estimate.landed == 0
    with pytest.raises(ConfigError, match=r"no kill would land: the first kill comes at 55\.8 s"):
        check_plan(result, f, FAST, "FixedSteps", 100)
    # ...and the loaded one: a save every 75 s, a kill every 30 s: hardly anything commits
    slow = Measured(300, 5.0, 0.75, 3, 0.5, 230.0)
    result = plan(f, slow, every=100, every_pinned=True)
    assert result.estimate.landed == 20 and result.estimate.commits_before_kills <= 1
    with pytest.raises(ConfigError, match="kills would come faster than checkpoints commit"):
        check_plan(result, f, slow, "FixedSteps", 100)
    check_plan(result, failure(tmp_path, "failure=poisson", "failure.check=false"), slow, "x", 100)


def test_a_derived_trace_schedule_is_the_trace_compressed_to_the_gap(tmp_path):
    f = failure(tmp_path, "failure=trace", "failure.path=null", "failure.times=[1.0,2.0]")
    result = plan(f, FAST, every=10, every_pinned=True)
    gap = FAST.training / f.target_kills
    assert result.times == pytest.approx([gap, 2 * gap]) and result.every is None
    assert "compression" in result.schedule and "derived" in result.schedule


@pytest.mark.parametrize(
    "overrides",
    [["failure=poisson"], ["failure=trace", "failure.path=null", "failure.times=[1.0,2.0]"]],
    ids=["poisson", "trace"],
)
def test_a_slow_start_up_does_not_move_derived_kills(tmp_path, overrides):
    # The reference run is the first process on a cold page cache: its start-up can take
    # several times a later one's. On the training clock that cannot shift the kills.
    f = failure(tmp_path, *overrides)
    cold = dataclasses.replace(FAST, startup=10 * FAST.startup)
    warm, slow = plan(f, FAST, every=10), plan(f, cold, every=10)
    assert slow.times == pytest.approx(warm.times) and slow.clock is KillClock.TRAINING
    assert slow.estimate.landed == warm.estimate.landed >= 2
    # explicit times stay on the job clock, where start-ups take time
    explicit = failure(tmp_path, "failure=poisson", "failure.mtbf=5")
    assert plan(explicit, FAST, every=10).clock is KillClock.JOB


def test_a_derived_schedule_needs_the_reference_run(tmp_path):
    f = failure(tmp_path, "failure=poisson", "failure.reference=false")
    with pytest.raises(ConfigError, match=r"failure\.mtbf=null derives .* failure\.reference=true"):
        plan(f, None)
    # without a measurement the schedule is in units of the mean gap
    assert kill_times(f) == pytest.approx(poisson_times(1.0, f.max_kills, f.seed))


def test_the_estimate_follows_restarts_and_checkpoints():
    m = Measured(steps=100, startup=1.0, step_seconds=0.1, commits=10, durable=0.0, wall=11.0)
    # a kill at 6 s: 50 steps done, durable at 50 (every 10); the restart finishes at 12 s
    est = estimate([6.0, 11.5, 30.0], m, restart_delay=0.0, every=10)
    assert est.landed == 2 and est.commits_before_kills >= 5
    assert estimate([0.5], m, 0.0, 10).commits_before_kills == 0  # killed while starting


@pytest.mark.slow
def test_the_app_refuses_a_schedule_that_cannot_land_with_exit_code_2(tmp_path, app_env):
    result = run_module(
        "pcframe.apps.run",
        "workload=tiny",
        "threads=1",
        "steps=50",
        "failure=poisson",
        "failure.mtbf=1000",
        f"hydra.run.dir={tmp_path / 'out'}",
        cwd=tmp_path,
        env=app_env,
    )
    assert result.returncode == 2, result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("pcframe-run: error")]
    assert "no kill would land" in line and "failure.mtbf=null" in line
