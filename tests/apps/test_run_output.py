"""What pcframe-run tells its user: progress, an honest summary, warnings, files, sweeps."""

from __future__ import annotations

import csv
import json
import math
import os
import statistics

import pytest

from pcframe.apps.machine import ENGINE_RESERVE, resolve_threads, usable_cpus
from pcframe.apps.run import run
from pcframe.apps.summary import baseline_spread, overhead_text, print_summary
from pcframe.errors import ConfigError
from tests.apps.conftest import compose, run_module

TINY = ("workload=tiny", "threads=1")


def test_threads_auto_leaves_a_core_to_the_engine():
    assert resolve_threads("auto") == max(1, usable_cpus() - ENGINE_RESERVE)
    assert usable_cpus() <= len(os.sched_getaffinity(0))
    assert resolve_threads(3) == 3 and resolve_threads("2") == 2
    for bad in (0, -1, "many", 1.5, True):
        with pytest.raises(ConfigError, match="threads="):
            resolve_threads(bad)
    # threads=5000 started 10000 threads and starved every other process of new ones.
    with pytest.raises(ConfigError, match=r"threads=5000 is invalid: at most \d+ on this"):
        resolve_threads(5000)
    assert resolve_threads(4 * (os.cpu_count() or 1)) == 4 * (os.cpu_count() or 1)


def test_the_shipped_configs_default_to_threads_auto(tmp_path):
    assert compose("run", directory=tmp_path).threads == "auto"
    assert compose("tune", directory=tmp_path).threads == "auto"


def test_the_overhead_has_a_spread_only_from_enough_baseline_runs():
    """Two baseline runs' difference was printed as "± 2.0 %", an uncertainty it is not."""
    two = overhead_text(12.0, [100.0, 98.0])
    assert "±" not in two and two.startswith("+12.0 % ") and "within noise" not in two
    assert "2 baseline runs" in two and "too few" in two  # what it is from, said
    assert "±" not in overhead_text(12.0, [100.0]) and "1 baseline run:" in overhead_text(
        12.0, [100.0]
    )
    # from 3 runs on: the sample standard deviation, in % of their mean, and how many runs
    rates = [100.0, 104.0, 96.0]
    sd = 100 * statistics.stdev(rates) / statistics.fmean(rates)
    assert overhead_text(12.0, rates) == f"+12.0 % ± {sd:.1f} % (sd of 3 baseline runs)"
    assert overhead_text(3.0, rates).endswith("(within noise)")
    assert baseline_spread([100.0, 98.0]) == (pytest.approx(200 / 99), None)


def test_three_baseline_runs_give_the_overhead_a_spread(tmp_path):
    cfg = compose(
        "run", *TINY, "steps=10", "progress=false", "policy.interval.every=5",
        "baseline_runs=3", directory=tmp_path / "ckpt",
    )  # fmt: skip
    summary = run(cfg)
    assert summary["baseline_runs"] == 3 and summary["checkpoints"] == 2
    assert summary["overhead_noise_pct"] is not None
    assert "±" in summary["overhead"] and "(sd of 3 baseline runs)" in summary["overhead"]


def test_a_run_that_commits_nothing_says_so_and_why(tmp_path, capsys):
    cfg = compose("run", *TINY, "steps=20", "progress=false", directory=tmp_path / "ckpt")
    summary = run(cfg)
    assert summary["checkpoints"] == 0
    assert summary["overhead"] == "n/a: no checkpoint committed"
    (warning,) = summary["warnings"]
    assert "no checkpoint was committed" in warning
    assert "every 100 steps, but the run had 20 steps" in warning
    assert "interval is longer than the run" in warning
    assert "policy.interval.every=4" in warning  # the fix, with a value that works
    assert summary["policy"] == "FixedSteps: every 100 steps"


def test_a_time_policy_that_never_saves_names_its_interval(tmp_path):
    cfg = compose(
        "run", *TINY, "steps=20", "progress=false", "policy/interval=young", "baseline=false",
        directory=tmp_path / "ckpt",
    )  # fmt: skip
    (warning,) = run(cfg)["warnings"]
    assert "Young's interval is" in warning and "longer than the run" in warning


def test_summary_prints_the_whole_path_and_the_next_command(tmp_path, capsys):
    from rich.console import Console

    deep = tmp_path / ("a-rather-long-folder-name-" * 4) / "checkpoints"
    summary = {"steps": 10, "checkpoints": 1, "directory": str(deep), "warnings": ["x"]}
    print_summary(summary, console=Console(width=80, force_terminal=False))
    out = capsys.readouterr().out
    assert f"checkpoints: {deep}\n" in out
    assert f"next: pcframe list {deep}\n" in out
    assert "WARNING" in out


@pytest.mark.slow
def test_a_multirun_warns_writes_summaries_and_one_merged_table(tmp_path, app_env):
    sweep = tmp_path / "sweep"
    result = run_module(
        "pcframe.apps.run",
        "-m",
        "policy.interval.every=5,100",
        *TINY,
        "steps=20",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        env={**app_env, "COLUMNS": "80"},
    )
    assert result.returncode == 0, result.stderr
    # progress: one line per phase, even without a terminal
    for phase in ("warm-up", "without checkpoints (1 of 2)", "with checkpoints"):
        assert f"{phase}: " in result.stderr
    # job 1 (every 100 steps, 20 steps): a loud warning saying why
    assert "WARNING" in result.stdout and "no checkpoint was committed" in result.stdout
    for job in ("0", "1"):
        ckpt = sweep / job / "checkpoints"
        assert f"checkpoints: {ckpt}\n" in result.stdout  # whole, at 80 columns
        assert f"next: pcframe list {ckpt}\n" in result.stdout
    document = json.loads((sweep / "1" / "summary.json").read_text())
    assert document["summary"]["checkpoints"] == 0 and document["warnings"]
    assert "policy.interval.every=100" in document["overrides"]
    (row,) = csv.DictReader((sweep / "0" / "summary.csv").open())
    assert row["checkpoints"] == "4" and row["workload"] == "mlp"
    # ...and the merged table
    assert "pcframe-run sweep: 2 jobs" in result.stdout
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert [(r["job"], r["policy.interval.every"], r["checkpoints"]) for r in rows] == [
        ("0", "5", "4"),
        ("1", "100", "0"),
    ]
    assert "no checkpoint was committed" in rows[1]["warnings"]
    assert rows[0]["overhead_pct"] and rows[0]["baseline_runs"] == "2"
    # two baseline runs: no ± anywhere a sweep's reader looks
    assert rows[0]["overhead_noise_pct"] == "" and "±" not in rows[0]["overhead"]
    assert "2 baseline runs" in rows[0]["overhead"]
    assert "±" not in result.stdout
    table = (sweep / "sweep_summary.md").read_text()
    assert "| job | policy.interval.every |" in table and "job 1: no checkpoint" in table
    assert "±" not in table


@pytest.mark.slow
def test_the_smoke_experiment_kills_twice_and_resumes_bit_identically(tmp_path, app_env):
    """The README's demo, end to end: the schedule fits whatever speed this machine has."""
    out = tmp_path / "hydra"
    result = run_module(
        "pcframe.apps.run", "experiment=smoke", f"hydra.run.dir={out}", cwd=tmp_path, env=app_env
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["kills"] == 2 and summary["processes"] == 3
    assert summary["checkpoints"] > 10  # committed between the kills
    assert summary["matches_reference"] == "yes, bit-identical"
    assert "derived" in summary["schedule"]


def test_a_missing_trace_file_is_refused_before_the_reference_run(tmp_path, monkeypatch):
    """It was named only after the whole reference run had trained (7 s here, minutes on a
    real workload), though configuration.md says nothing has run yet."""
    monkeypatch.chdir(tmp_path)
    cfg = compose(
        "run", *TINY, "steps=20", "progress=false", "failure=trace", "failure.path=my.csv",
        f"hydra.run.dir={tmp_path / 'out'}", directory=tmp_path / "ckpt",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"failure\.path='my\.csv': no such trace file"):
        run(cfg, out_dir=tmp_path / "out")
    assert not (tmp_path / "out" / "reference-checkpoints").exists()
    assert not (tmp_path / "out" / "logs").exists()


@pytest.mark.parametrize(("seconds", "shown"), [(1e308, "1e+308 s"), (math.inf, "inf s")])
def test_an_absurd_interval_is_shown_in_a_few_characters(tmp_path, seconds, shown):
    """policy.interval.seconds=1e308 put its interval in 309 digits (and 100 commas) into
    the warning of a run that committed nothing."""
    from pcframe.apps.policy_text import describe_policy, no_commit_reason
    from pcframe.policies import FixedTime, Young

    cfg = compose("run", *TINY, "steps=20", directory=tmp_path / "ckpt")
    warning = no_commit_reason(FixedTime(seconds), cfg, 0.25, 0, [])
    assert f"FixedTime's interval is {shown}, but training took 0.2 s" in warning
    assert len(warning) < 300
    young = Young(mtbf=3600.0)
    young.last_interval = seconds
    assert describe_policy(young) == f"Young: interval {shown} (as last computed)"
    young.last_interval = 12345.67  # an ordinary one keeps its digits
    assert describe_policy(young) == "Young: interval 12,345.7 s (as last computed)"
