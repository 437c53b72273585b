"""pcframe-run as a console script: preemption injection, multirun sweeps, clear errors."""

from __future__ import annotations

import re
import time

import pytest

from pcframe.store.directory import CheckpointDir
from tests.apps.conftest import run_module


def value(stdout: str, label: str) -> str:
    match = re.search(rf"{re.escape(label)}\s*│\s*(.+?)\s*│", stdout)
    assert match, f"{label!r} not in the summary:\n{stdout}"
    return match.group(1)


@pytest.mark.slow
def test_failure_trace_kills_restarts_and_reports(tmp_path, app_env):
    ckpt = tmp_path / "ckpt"
    result = run_module(
        "pcframe.apps.run",
        "experiment=smoke",
        "steps=200",
        "failure.times=[1.0]",  # during the first process's start-up: a kill before any step
        "failure.compression=1.0",  # wall seconds as given (smoke derives its schedule)
        "failure.reference=false",  # the bit-identical check: test_supervisor.py
        f"storage.directory={ckpt}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        cwd=tmp_path,
        env=app_env,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert value(out, "preemptions injected (SIGKILL)") == "1"
    assert value(out, "training processes started") == "2"
    assert value(out, "steps lost to preemptions") == "0"
    assert "final model equals" not in out  # no reference run was asked for
    assert float(value(out, "goodput (useful steps/s)")) > 0
    assert CheckpointDir(ckpt).committed_versions()  # the supervised run checkpointed
    logs = tmp_path / "hydra" / "logs" / "supervised"
    assert sorted(p.name for p in logs.iterdir()) == ["child-0.stderr", "child-1.stderr"]


@pytest.mark.slow
def test_multirun_sweep_with_the_basic_launcher(tmp_path, app_env):
    sweep = tmp_path / "sweep"
    result = run_module(
        "pcframe.apps.run",
        "-m",
        "engine.max_in_flight=1,3",
        "workload=tiny",
        "steps=20",
        "threads=1",
        "baseline=false",
        "policy.interval.every=10",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        env=app_env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("pcframe-run summary") == 2
    one, three = (CheckpointDir(sweep / j / "checkpoints").committed_versions() for j in "01")
    assert one == [1, 2]
    # With 3 in flight, version 1 finishing after version 2 is discarded (by design): the
    # newest stands, and nothing else does.
    assert three[-1] == 2 and set(three) <= {1, 2}
    assert "max_in_flight: 3" in (sweep / "1" / ".hydra" / "config.yaml").read_text()


@pytest.mark.slow
def test_a_sweep_whose_jobs_share_one_directory_stops_before_the_second_trains(tmp_path, app_env):
    """Before: job 1 resumed job 0's final checkpoint, trained 0 steps, exit 0, its row in
    the sweep table as if it were a result."""
    shared = tmp_path / "shared"

    def sweep(name, *directory):
        return run_module(
            "pcframe.apps.run",
            "-m",
            "policy.interval.every=5,10",
            "workload=tiny",
            "steps=10",
            "threads=1",
            "baseline=false",
            "progress=false",
            *directory,
            f"hydra.sweep.dir={tmp_path / name}",
            cwd=tmp_path,
            env=app_env,
        )

    result = sweep("one", f"directory={shared}")
    assert result.returncode == 2, result.stderr
    assert f"directory={shared} is job 0's checkpoint directory too" in result.stderr
    assert result.stdout.count("pcframe-run summary") == 1  # job 1 trained nothing
    per_job = sweep("two", f"directory={tmp_path}/per-job/${{hydra:job.num}}")
    assert per_job.returncode == 0, per_job.stderr
    assert CheckpointDir(tmp_path / "per-job" / "1").committed_versions()


def test_ctrl_c_ends_the_run_with_one_line_and_keeps_what_was_committed(tmp_path, app_env):
    """Ctrl-C printed a 20-frame traceback of KeyboardInterrupt."""
    import signal
    import subprocess
    import sys

    ckpt, stderr_file = tmp_path / "ckpt", tmp_path / "stderr.txt"
    args = ["workload=tiny", "steps=1000000", "baseline=false", "progress=false"]
    args += ["policy/interval=fixed_steps", "policy.interval.every=50"]
    with open(stderr_file, "w") as stderr:
        run = subprocess.Popen(
            [sys.executable, "-m", "pcframe.apps.run", *args, f"storage.directory={ckpt}"],
            cwd=tmp_path,
            env=app_env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            # Ctrl-C's default in the child, whatever this process does with SIGINT (an
            # ignored SIGINT is inherited, and Python then leaves it ignored)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 120
        while not CheckpointDir(ckpt).committed_versions():  # training, and saving
            assert run.poll() is None and time.monotonic() < deadline, stderr_file.read_text()
            time.sleep(0.1)
        run.send_signal(signal.SIGINT)
        run.wait(timeout=120)
    finally:
        run.kill()
    lines = stderr_file.read_text()
    assert run.returncode == 130, lines
    assert "Traceback" not in lines and "KeyboardInterrupt" not in lines, lines
    assert "interrupted (Ctrl-C)" in lines.strip().splitlines()[-1]
    assert CheckpointDir(ckpt).committed_versions()
