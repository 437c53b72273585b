"""pcframe-tune: real measurements, pruning, Pareto mode, resumable storages, tuned config."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState

from pcframe.apps.run import run
from pcframe.apps.tuning import Tuner, best_trial, engine_values, open_storage, parse_space, plot
from pcframe.errors import ConfigError
from tests.apps.conftest import compose, run_module

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
PNG = b"\x89PNG\r\n\x1a\n"


def quick(tmp_path, *overrides: str):
    """Overrides for a tiny, quick study whose files all stay in tmp_path."""
    return [
        "workload=tiny",
        "tune=quick",
        "threads=1",  # a tiny model on a shared 2-core machine: threads only contend
        "tune.progress=false",
        f"tune.report_dir={tmp_path / 'report'}",
        f"tune.write_config={tmp_path / 'user-conf' / 'engine' / 'tuned.yaml'}",
        *overrides,
    ]


def tuner(tmp_path, *overrides: str) -> Tuner:
    base = quick(tmp_path, *overrides)
    directory = tmp_path / "ckpt"
    cfg = compose("tune", *base, directory=directory)
    return Tuner(cfg, compose=lambda extra: compose("tune", *base, *extra, directory=directory))


def load(url: str, name: str = "pcframe-quick") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(url))


@pytest.mark.slow
def test_cli_tunes_writes_a_config_that_pcframe_run_uses(tmp_path, app_env, monkeypatch):
    db = f"sqlite:///{tmp_path / 'study.db'}"
    result = run_module(
        "pcframe.apps.tune",
        *quick(tmp_path, f"tune.storage={db}"),
        f"hydra.run.dir={tmp_path / 'hydra'}",
        cwd=tmp_path,
        env=app_env,
    )
    assert result.returncode == 0, result.stderr
    assert "pcframe-run engine=tuned" in result.stdout
    study = load(db)
    trials = study.get_trials(states=FINISHED)
    assert len(trials) == 3
    assert study.trials[0].user_attrs.get("base") is True  # the base engine is trial 0
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        # measured, not made up: step times, stall and staging memory of a real run
        assert t.user_attrs["baseline_step_s"] > 0 and t.user_attrs["checkpoint_step_s"] > 0
        assert t.user_attrs["memory_bytes"] >= t.params["chunk_bytes"]
        assert t.values[0] == pytest.approx(t.user_attrs["overhead"])
        assert len(t.intermediate_values) == 2  # one report per A/B repeat (for pruning)
    table = (tmp_path / "report" / "tune_trials.md").read_text()
    assert table.count("\n| ") == 1 + len(study.trials)  # header + one row per trial
    assert (tmp_path / "report" / "tune_plot.png").read_bytes().startswith(PNG)

    tuned = tmp_path / "user-conf" / "engine" / "tuned.yaml"
    best = best_trial(study, ["overhead"])
    knobs = parse_space(compose("tune", *quick(tmp_path), directory=tmp_path).tune.space)
    expected = engine_values(knobs, best.params)  # names of dict values -> the dicts
    written = OmegaConf.to_container(OmegaConf.load(tuned))
    assert {k: written[k] for k in expected} == expected

    # pcframe-run finds engine=tuned in $PCFRAME_CONFIG_DIR and checkpoints with it.
    monkeypatch.setenv("PCFRAME_CONFIG_DIR", app_env["PCFRAME_CONFIG_DIR"])
    ckpt = tmp_path / "run-ckpt"
    cfg = compose(
        "run",
        "engine=tuned",
        "workload=tiny",
        "steps=20",
        "threads=1",
        "baseline=false",
        "policy.interval.every=10",
        directory=ckpt,
    )
    summary = run(cfg)
    assert summary["checkpoints"] == 2
    manifest = (ckpt / "v00000002" / "manifest.json").read_text().split("\n", 1)[1]
    used = json.loads(manifest)["engine"]["config"]
    assert {k: used[k] for k in expected} == expected


def test_study_resumes_in_the_same_storage(tmp_path):
    url = f"journal://{tmp_path / 'study.log'}"  # the multi-process journal file
    first = tuner(tmp_path, f"tune.storage={url}", "tune.n_trials=2")
    first.run()
    before = [(t.number, t.state, t.params) for t in load(url).trials]
    assert len(before) == 2
    again = tuner(tmp_path, f"tune.storage={url}", "tune.n_trials=3")
    study = again.run()
    after = [(t.number, t.state, t.params) for t in study.trials]
    assert after[:2] == before and len(after) == 3 and after[2][0] == 2
    # asking for what is already there runs nothing
    assert len(tuner(tmp_path, f"tune.storage={url}", "tune.n_trials=3").run().trials) == 3


@pytest.mark.slow
def test_killed_worker_trial_is_failed_and_retried(tmp_path, app_env):
    db = f"sqlite:///{tmp_path / 'study.db'}"
    args = quick(tmp_path, f"tune.storage={db}", "tune.heartbeat=1", "tune.n_trials=2")
    args += ["tune.steps=400", "tune.interval=100", f"hydra.run.dir={tmp_path / 'hydra'}"]
    worker = subprocess.Popen(
        [sys.executable, "-m", "pcframe.apps.tune", *args],
        cwd=tmp_path,
        env=app_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    running = None
    while running is None and time.monotonic() < deadline:
        time.sleep(0.3)
        try:
            running = next(iter(load(db).get_trials(states=(TrialState.RUNNING,))), None)
        except KeyError:
            continue  # the study is not created yet
    assert running is not None, "the worker never started a trial"
    time.sleep(1.0)  # inside the trial's measurement
    worker.send_signal(signal.SIGKILL)
    assert worker.wait(timeout=30) == -signal.SIGKILL
    assert load(db).trials[running.number].state == TrialState.RUNNING  # left behind
    # A restarted worker must come up after the grace period (2 beats = 2 s). SQLite's
    # CURRENT_TIMESTAMP, which Optuna compares, has whole-second resolution, so a beat
    # written at 10.0 s and a check at 12.9 s read as 2 s apart, not stale yet: wait
    # grace + one second of truncation on each side.
    time.sleep(4.2)
    study = tuner(tmp_path, f"tune.storage={db}", "tune.heartbeat=1", "tune.n_trials=2").run()
    killed = study.trials[running.number]
    assert killed.state == TrialState.FAIL
    # The retry is marked with the dead trial's number and reruns the parameters it had been
    # given when it died (the snapshot above may predate some of its suggestions).
    retried = [
        t
        for t in study.get_trials(states=(TrialState.COMPLETE,))
        if t.system_attrs.get("failed_trial") == running.number
        and all(t.params.get(k) == v for k, v in killed.params.items())
    ]
    assert retried, "the killed trial's configuration was not run again"
    assert len(study.get_trials(states=FINISHED)) == 2


def test_multi_objective_memory_budget_and_pareto_front(tmp_path):
    chunk = 65536
    t = tuner(
        tmp_path,
        "tune.objectives=[stall,memory]",
        f"tune.memory_budget={3 * chunk}",
        "tune.storage=null",
        "tune.n_trials=3",
        f"tune.space.chunk_bytes.choices=[{chunk}]",
    )
    study = t.create_study(enqueue_base=False)
    fixed = {"max_in_flight": 1, "writer_threads": 1, "o_direct": "off", "checksum": "crc32c"}
    fixed |= {"copy_backend": "torch", "codecs": "raw"}
    for ratio in (0.5, 2.0, 1.0):
        fixed_ratio = {**fixed, "chunk_bytes": chunk, "staging_ratio": ratio}
        study.enqueue_trial(fixed_ratio)
    t.run(study)
    by_ratio = {tr.params["staging_ratio"]: tr for tr in study.trials}
    over = by_ratio[2.0]
    assert over.state == TrialState.PRUNED
    assert "tune.memory_budget" in over.user_attrs["pruned_because"]
    for ratio in (0.5, 1.0):
        tr = by_ratio[ratio]
        assert tr.state == TrialState.COMPLETE
        state_bytes = tr.user_attrs["checkpoint_bytes"]
        expected = math.ceil(state_bytes * ratio / chunk) * chunk  # the engine's staging pool
        assert tr.values[1] == tr.user_attrs["memory_bytes"] == expected <= 3 * chunk
        assert tr.values[0] == pytest.approx(tr.user_attrs["stall_s"]) and tr.values[0] >= 0
    front = {tr.number for tr in study.best_trials}
    assert front and front <= {tr.number for tr in study.get_trials(states=(TrialState.COMPLETE,))}
    chosen = best_trial(study, t.objectives)
    assert chosen.number in front
    assert plot(study, t.objectives, tmp_path / "pareto.png").read_bytes().startswith(PNG)


def test_hopeless_trial_is_pruned_once_the_warmup_reports_are_in(tmp_path):
    # With the memory objective every report is exact, so the pruner's decision is certain.
    t = tuner(
        tmp_path,
        "tune.objectives=[memory]",
        "tune.storage=null",
        "tune.n_trials=2",
        "tune.pruner_startup_trials=1",
        "tune.repeats=4",  # the pruner waits for repeats // 2 = 2 reports
    )
    study = t.create_study(enqueue_base=False)
    assert isinstance(study.pruner, optuna.pruners.MedianPruner)
    common = {"max_in_flight": 1, "writer_threads": 1, "o_direct": "off", "checksum": "crc32c"}
    common |= {"copy_backend": "torch", "codecs": "raw"}
    study.enqueue_trial({**common, "chunk_bytes": 65536, "staging_ratio": 0.5})
    study.enqueue_trial({**common, "chunk_bytes": 262144, "staging_ratio": 2.0})
    t.run(study)
    small, big = study.trials
    assert small.state == TrialState.COMPLETE and len(small.intermediate_values) == 4
    assert big.state == TrialState.PRUNED
    assert list(big.intermediate_values) == [0, 1, 2]  # stopped after 3 of 4 repeats
    assert big.intermediate_values[2] > small.value


@pytest.mark.slow
def test_several_workers_share_a_postgresql_study(tmp_path, app_env, postgres_url):
    workers = []
    for index in range(2):
        args = quick(
            tmp_path / f"w{index}",
            f"tune.storage={postgres_url}",
            "tune.n_trials=4",
            "tune.seed=null",
            f"hydra.run.dir={tmp_path / f'hydra{index}'}",
        )
        workers.append(
            subprocess.Popen(
                [sys.executable, "-m", "pcframe.apps.tune", *args],
                cwd=tmp_path,
                env=app_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for worker in workers:
        _, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err
    study = load(postgres_url)
    finished = study.get_trials(states=FINISHED)
    # MaxTrialsCallback stops both workers at 4; a trial each may already be under way.
    assert 4 <= len(finished) <= 5
    assert len({t.user_attrs["worker"] for t in study.trials}) == 2
    assert [t.number for t in study.trials] == list(range(len(study.trials)))


@pytest.mark.parametrize(
    ("override", "text"),
    [
        ("tune.objectives=[speed]", "tune.objectives"),
        ("tune.sampler=cmaes", "tune.sampler"),
        ("tune.n_trials=0", "tune.n_trials"),
        ("+tune.space.turbo={type:categorical,choices:[yes]}", "tune.space.turbo"),
        ("+tune.space.max_in_flight.lo=1", "tune.space.max_in_flight.lo"),
        # trials the sampler sent past 64 failed one by one, each after its composition
        ("+tune.space.max_in_flight={type:int,low:1,high:100}", "the value 100 in its range"),
        ("+tune.space.checksum={type:categorical,choices:[crc32c,md4]}", "the value 'md4'"),
        # an empty name found no stored study again; sqlite:/// stored nothing
        ("tune.study_name=''", "tune.study_name=''"),
    ],
    ids=str,
)
def test_bad_tune_settings_name_the_key(tmp_path, override, text):
    with pytest.raises(ConfigError, match=text.replace(".", r"\.")):
        tuner(tmp_path, override)


def test_bad_storage_url_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"tune\.storage='study\.db'"):
        tuner(tmp_path, "tune.storage=study.db").create_study()
    for memory in ("sqlite://", "sqlite:///", "sqlite:///:memory:"):  # stored nowhere
        with pytest.raises(ConfigError, match="names no database file"):
            open_storage(memory)


def test_a_range_refused_only_beside_some_values_of_another_knob_is_searched(tmp_path):
    """A 4 MiB staging budget is below the base engine's 16 MiB chunk, but fine with a
    1 MiB chunk, which the space also holds: the trials prune the combination; the study
    must not be refused for it (a check against the base engine alone refused it)."""
    space = [
        "+tune.space.chunk_bytes={type:categorical,choices:[1048576,16777216]}",
        "+tune.space.staging_bytes={type:int,low:4194304,high:1073741824}",
    ]
    names = {k.name for k in tuner(tmp_path, *space).knobs}
    assert {"chunk_bytes", "staging_bytes"} <= names


@pytest.mark.parametrize("preset", ["quick", "default", "matrix", "multi"])
def test_the_shipped_search_spaces_stay_within_what_the_engine_takes(tmp_path, preset):
    assert tuner(tmp_path, f"tune={preset}").knobs


@pytest.mark.parametrize(
    ("url", "text"),
    [
        ("sqlite:////proc/nope/x.db", r"cannot create the folder '/proc/nope'"),
        ("sqlite:////proc/x.db", r"cannot open the database \(unable to open database file\)"),
        ("journal:////proc/nope/x.log", r"cannot create the folder '//proc/nope'"),
    ],
    ids=["folder", "file", "journal"],
)
def test_a_storage_that_cannot_be_opened_is_one_line_naming_the_key(url, text):
    """These were raw tracebacks from mkdir and SQLAlchemy."""
    with pytest.raises(ConfigError, match=rf"^tune\.storage='{re.escape(url)}': {text}") as err:
        open_storage(url)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("url", ["postgres://u@localhost/db", "SQLITE:///x.db", "://x"])
def test_a_storage_url_of_no_known_database_is_one_line_naming_the_key(url):
    """postgres:// (the name Heroku and Docker images use), an upper-case scheme or a URL
    without one reached SQLAlchemy and ended in a raw NoSuchModuleError / ArgumentError."""
    with pytest.raises(ConfigError, match=rf"^tune\.storage='{re.escape(url)}' is not a") as err:
        open_storage(url)
    assert "\n" not in str(err.value)


def test_a_journal_that_is_not_a_regular_file_is_refused_not_opened(tmp_path):
    """A FIFO as the journal blocked the open for ever."""
    fifo = tmp_path / "journal.log"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="exists and is not a regular file"):
        open_storage(f"journal:///{fifo}")


def test_best_trial_prefers_the_best_mean_of_remeasured_configurations():
    study = optuna.create_study()
    dist = {"x": optuna.distributions.CategoricalDistribution(["a", "b", "c"])}
    for x, value in (("a", 1.0), ("b", 0.5), ("b", 2.0), ("c", 0.8), ("c", 0.9)):
        study.add_trial(optuna.trial.create_trial(params={"x": x}, distributions=dist, value=value))
    # b had the single best draw (0.5) but its mean is 1.25; c is reliably better
    assert best_trial(study, ["overhead"]).params == {"x": "c"}
    lone = optuna.create_study()
    for x, value in (("a", 1.0), ("b", 0.5)):
        lone.add_trial(optuna.trial.create_trial(params={"x": x}, distributions=dist, value=value))
    assert best_trial(lone, ["overhead"]).params == {"x": "b"}


def test_confirmation_remeasures_the_leader(tmp_path):
    t = tuner(
        tmp_path, "tune.storage=null", "tune.n_trials=2", "tune.confirm=1", "tune.pruner=none"
    )
    study = t.run()
    leader = min(study.trials[:2], key=lambda tr: tr.value)
    # The leader is measured again, and the base engine too when it is not the leader (which
    # of the two leads is up to the machine's noise).
    again, *base = study.trials[2:]
    assert len(base) == (0 if leader.user_attrs.get("base") else 1)
    assert all(t.user_attrs.get("confirmation") is True for t in [again, *base])
    assert again.params == leader.params and again.state == TrialState.COMPLETE
    # only configurations measured twice can be written: the leader, or the base if remeasured
    written = best_trial(study, ["overhead"]).params
    assert written in [leader.params, *(t.params for t in base)]


def test_a_tuned_config_path_pcframe_run_cannot_find_is_refused_before_the_study(tmp_path):
    """Before: the study ran, wrote /x/tuned.yaml and printed a command (engine=tuned) that
    failed, since pcframe-run looks up <folder>/engine/<name>.yaml."""
    from pcframe.apps.tune import check_config_path
    from pcframe.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"write it to e\.g\. {tmp_path}/engine/tuned\.yaml"):
        check_config_path(str(tmp_path / "tuned.yaml"))
    with pytest.raises(ConfigError, match=r"engine/<name>\.yaml"):
        check_config_path(str(tmp_path / "engine" / "tuned.json"))
    check_config_path(str(tmp_path / "engine" / "mine.yaml"))  # where engine=mine finds it
    check_config_path(None)


def test_a_killed_runs_trial_folder_is_removed_by_the_next_run_and_no_other(tmp_path):
    """A SIGKILLed pcframe-tune left its trial's checkpoints behind for ever. The next run
    removes folders of this host's dead processes only: a running process's folder and
    another host's (a study shared over a network file system) stay."""
    from pathlib import Path

    from pcframe.apps.tuning.trial_dirs import (
        held_trial,
        remove_orphaned_trials,
        trial_directory,
    )

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    mine = trial_directory(tmp_path, 3)
    dead = tmp_path / f"{mine.name.rsplit('-', 1)[0]}-{gone.pid}"
    other_host = tmp_path / f"trial-4-elsewhere.example-{gone.pid}"
    unrelated = tmp_path / "notes-1-x-2"
    for folder in (mine, dead, other_host, unrelated):
        (folder / "v00000001").mkdir(parents=True)
    assert remove_orphaned_trials(tmp_path) == [dead]
    assert not dead.exists() and mine.exists() and other_host.exists() and unrelated.exists()
    assert remove_orphaned_trials(tmp_path / "missing") == []
    # A running trial holds a lock beside its folder: never removed, even when its pid
    # means nothing here (another PID namespace with this host name); released, it goes.
    with held_trial(tmp_path, 5) as running:
        running.mkdir()
        alias = tmp_path / f"{running.name.rsplit('-', 1)[0]}-{gone.pid}"
        running.rename(alias)
        Path(f"{running}.lock").rename(f"{alias}.lock")  # the lock file keeps its open lock
        assert remove_orphaned_trials(tmp_path) == [] and alias.exists()
    assert remove_orphaned_trials(tmp_path) == [alias] and not Path(f"{alias}.lock").exists()
    lone = Path(f"{trial_directory(tmp_path, 6)}.lock")  # killed before making its folder
    lone.touch()
    remove_orphaned_trials(tmp_path)
    assert not lone.exists()
