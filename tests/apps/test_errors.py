"""Configuration mistakes end the real console scripts with one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException, OverrideParseException

from pcframe.apps.compose import engine_config
from pcframe.apps.errors import USAGE_ERROR, describe_error
from pcframe.errors import ConfigError
from pcframe.format.manifest import MAX_STEP
from tests.apps.conftest import compose


def script(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    assert exe.exists(), f"{name} is not installed: pip install -e . --no-deps"
    return str(exe)


def run_script(name: str, *args: str, cwd: Path, env: dict, timeout: float = 120):
    return subprocess.run(
        [script(name), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("override", "key", "fix"),
    [
        ("+engine.evry=5", "engine.evry", "engine's options are"),
        ("+policy.interval.erly=3", "policy.interval.erly", "it takes: every"),
        ("engine.max_in_flight=0", "engine.max_in_flight=0", "use 1..64"),
        # ran (training nothing, or a model without units) and exited 0 before
        ("steps=-5", "steps=-5", "a whole number >= 1"),
        ("steps=0", "steps=0", "a whole number >= 1"),
        ("workload.args.hidden=0", "workload.args.hidden=0", "a whole number >= 1"),
        # Hydra's "Error getting object" lines came before the one line
        ("policy.interval._target_=nosuch.Policy", "policy.interval._target_", "No module"),
        # reported in Hydra's wording, after the warm-up had run
        ("policy.interval.every=0", "policy.interval.every=0", "whole number of steps >= 1"),
        # Hydra advised "+policy=young", which fails again (policy is a folder of groups)
        ("policy=young", "policy is not a config group", "give policy/interval=young"),
        # composed, then silently ignored: pcframe-run has no tiers and no VMs to choose
        ("+policy/placement=single_tier", "policy/placement is used by pcframe-sim", "remove"),
    ],
    ids=str,
)
@pytest.mark.slow
def test_a_bad_override_is_one_line_and_exit_code_2(tmp_path, app_env, override, key, fix):
    result = run_script(
        "pcframe-run", override, f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path, env=app_env
    )
    assert result.returncode == USAGE_ERROR, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pcframe-run: error: ") and key in lines[0] and fix in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "out" / "checkpoints").exists()  # refused before anything ran


def test_a_bad_policy_argument_is_refused_before_a_supervised_run(tmp_path, app_env):
    """The children build the policy; the parent refuses it first, before the reference run."""
    args = ["failure=poisson", "policy.interval.every=0", f"hydra.run.dir={tmp_path / 'out'}"]
    result = run_script("pcframe-run", *args, cwd=tmp_path, env=app_env)
    assert result.returncode == USAGE_ERROR, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "policy.interval.every=0 is invalid" in line
    assert not (tmp_path / "out" / "reference-checkpoints").exists()


def test_a_kill_time_that_is_no_number_is_refused_before_anything_runs(tmp_path, app_env):
    """`failure.times=[nan]` was dropped without a word (NaN fails every comparison) and the
    run went ahead with fewer kills than asked for."""
    args = ["failure=trace", "failure.path=null", "failure.times=[nan]"]
    result = run_script("pcframe-run", *args, f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path,
                        env=app_env)  # fmt: skip
    assert result.returncode == USAGE_ERROR, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("pcframe-run: error: failure.times=[nan] is out of range"), line
    assert "finite numbers >= 0" in line
    assert not (tmp_path / "out" / "reference-checkpoints").exists()


def test_hydra_full_error_shows_the_trace(tmp_path, app_env):
    env = {**app_env, "HYDRA_FULL_ERROR": "1"}
    result = run_script(
        "pcframe-run", "engine.max_in_flight=0", f"hydra.run.dir={tmp_path}", cwd=tmp_path, env=env
    )
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "engine.max_in_flight=0" in result.stderr


def test_a_missing_tuned_engine_says_where_tuned_configs_are_looked_for(tmp_path, app_env):
    result = run_script(
        "pcframe-run", "engine=tuned", f"hydra.run.dir={tmp_path}", cwd=tmp_path, env=app_env
    )
    assert result.returncode == USAGE_ERROR
    (line,) = result.stderr.strip().splitlines()
    assert "engine=tuned: no such option" in line and "PCFRAME_CONFIG_DIR" in line
    assert app_env["PCFRAME_CONFIG_DIR"] in line and "does not exist" in line
    assert "engine_schema" not in line


@pytest.mark.slow
def test_help_lists_only_this_apps_groups(tmp_path, app_env):
    result = run_script("pcframe-run", "--help", cwd=tmp_path, env=app_env)
    assert result.returncode == 0, result.stderr
    groups = result.stdout.split("== Config groups", 1)[1].split("== Config (", 1)[0]
    assert "_schema" not in groups
    named = {line.split(":")[0].strip() for line in groups.splitlines()[1:] if ":" in line}
    assert named == {
        "workload",
        "engine",
        "kernels",
        "storage",
        "policy/interval",
        "failure",
        "experiment",
    }
    assert "smoke" in groups and "fixed_steps" in groups


# In-process: every kind of mistake the composer or the apps raise becomes one line.
@pytest.mark.parametrize(
    "overrides",
    [
        ["engine.max_inflight=3"],
        ["engine.max_in_flight=abc"],
        ["engine=nosuch"],
        ["workload.args.hiden=3"],
        ["workload=gpt", "workload.args.width=wide"],
        ["stepz=3"],
        ["engine.max_in_flight=[1"],
        ["+policy.interval.evry=3"],
        ["threads=1.5"],
        ["baseline_runs=0"],
        # out of range (pcframe.apps.bounds)
        ["steps=0"],
        ["workload.args.hidden=0"],
        ["workload.args.lr=0"],
        ["workload.args.dropout=1.5"],
        ["workload=gpt", "workload.args.heads=0"],
        ["workload=gpt", "workload.args.width=102"],
        ["failure=poisson", "failure.timeout=0"],
        ["failure=poisson", "failure.max_kills=-1"],
        ["failure=trace", "failure.offset=-1"],
        ["failure=trace", "failure.offset=inf"],
        # dropped without a word before: fewer kills than asked for
        ["failure=trace", "failure.path=null", "failure.times=[1.0,nan]"],
        ["failure=trace", "failure.path=null", "failure.times=[inf]"],
    ],
    ids=str,
)
def test_every_composition_error_is_described_in_one_line(overrides, tmp_path):
    with pytest.raises((ConfigCompositionException, OverrideParseException, ConfigError)) as info:
        compose("run", *overrides, directory=tmp_path)
    code, text = describe_error(info.value)
    assert code == USAGE_ERROR and text and "\n" not in text
    assert overrides[-1].split("=")[0].lstrip("+") in text


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("tune.steps=0", "tune.steps=0 is out of range: give a whole number >= 1"),
        ("tune.repeats=-1", "tune.repeats=-1 is out of range"),
        ("tune.warmup_steps=-1", "tune.warmup_steps=-1 is out of range: give a whole number >= 0"),
        ("tune.timeout=0", "tune.timeout=0.0 is out of range: give a number > 0 or null"),
        ("tune.memory_budget=0", "tune.memory_budget=0 is out of range"),
        ("workload.args.batch_size=0", "workload.args.batch_size=0 is out of range"),
        # accepted before: a step no checkpoint's manifest can hold (its reader refuses it)
        (
            "tune.steps=99999999999999999999999",
            "tune.steps=99999999999999999999999 is out of range: give a whole number "
            "1..4,611,686,018,427,387,904",
        ),
    ],
    ids=str,
)
def test_tune_values_out_of_range_name_the_key_and_the_range(tmp_path, override, words):
    with pytest.raises(ConfigError) as info:
        compose("tune", override, directory=tmp_path)
    assert describe_error(info.value) == (USAGE_ERROR, str(info.value))
    assert words in str(info.value)


def test_a_step_count_no_checkpoint_can_hold_is_refused(tmp_path):
    """steps=99999999999999999999999 was accepted: pcframe-run trained towards a step that
    no checkpoint's manifest can record. The largest a reader takes is still accepted."""
    with pytest.raises(ConfigError) as info:
        compose("run", "steps=99999999999999999999999", directory=tmp_path)
    assert describe_error(info.value) == (USAGE_ERROR, str(info.value))
    assert str(info.value).startswith("steps=99999999999999999999999 is out of range: give ")
    assert "4,611,686,018,427,387,904" in str(info.value)
    compose("run", f"steps={MAX_STEP}", directory=tmp_path)


def test_values_in_range_and_the_shipped_configs_are_accepted(tmp_path):
    """The bounds refuse only what cannot work: edges that do (0 layers, 0 kills) pass."""
    for overrides in (
        ["workload.args.layers=0", "workload.args.dropout=0", "steps=1"],
        ["failure=poisson", "failure.max_kills=0", "failure.restart_delay=0"],
        ["experiment=smoke"],
        ["experiment=gpt_poisson"],
        ["experiment=pccheck_trace"],
    ):
        compose("run", *overrides, directory=tmp_path)
    for tune in ("quick", "default", "matrix", "multi"):
        compose("tune", f"tune={tune}", "tune.confirm=0", "tune.heartbeat=0", directory=tmp_path)


def test_engine_values_out_of_range_are_described(tmp_path):
    cfg = compose("run", "+engine.evry=5", directory=tmp_path)
    with pytest.raises(ConfigError) as info:
        engine_config(cfg)
    assert describe_error(info.value) == (USAGE_ERROR, str(info.value))


@pytest.mark.parametrize(
    ("app", "overrides", "words"),
    [  # both printed a traceback and "a bug: please report it" before
        ("pcframe-sim", ["traces={trace}", "progress=false"], "unknown trace format"),
        ("pcframe-tune", ["tune=quick", "workload=tiny", "tune.interval=0"], "tune.interval"),
    ],
    ids=["sim-trace-of-another-format", "tune-interval-0"],
)
def test_bad_input_found_after_composing_is_one_line_too(tmp_path, app_env, app, overrides, words):
    trace = tmp_path / "other.csv"
    trace.write_text("f,o\n1,2\n")
    args = [o.format(trace=trace) for o in overrides]
    result = run_script(app, *args, f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path, env=app_env)
    assert result.returncode == USAGE_ERROR, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("app", ["run", "sim"])
@pytest.mark.parametrize("override", ["policy=young", "+policy=young"])
def test_an_option_given_to_the_policy_folder_names_the_group_to_use(tmp_path, app, override):
    with pytest.raises(ConfigError) as info:
        compose(app, override, directory=tmp_path if app == "run" else None)
    code, line = describe_error(info.value, app)
    assert code == USAGE_ERROR and "\n" not in line
    assert "give policy/interval=young" in line  # the key to use, with the option
    assert "+policy" not in line and "append" not in line  # not Hydra's advice


@pytest.mark.parametrize("app", ["run", "sim", "tune"])
def test_version_names_pcframe_for_every_app(app, monkeypatch, capsys):
    """Hydra's own --version printed "Hydra 1.3.x": nothing about the app a user asks about."""
    import importlib

    from pcframe import __version__

    main = importlib.import_module(f"pcframe.apps.{app}").main  # the console script's entry
    monkeypatch.setattr(sys, "argv", [f"pcframe-{app}", "--version"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == f"pcframe-{app} (pcframe) {__version__}"
    assert second.startswith("Hydra ") and "Python " in second  # what it runs on, second


def test_version_of_the_installed_script(tmp_path, app_env):
    from pcframe import __version__

    result = run_script("pcframe-run", "--version", cwd=tmp_path, env=app_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"pcframe-run (pcframe) {__version__}\n")
    assert not (tmp_path / "outputs").exists()  # nothing run


@pytest.mark.parametrize("app", ["pcframe-run", "pcframe-sim"])
def test_an_output_folder_hydra_cannot_make_is_one_line(tmp_path, app_env, app):
    """Hydra makes hydra.run.dir before the app runs: a path through a file was a raw
    NotADirectoryError traceback, reported as a bug in pcframe."""
    (tmp_path / "afile").write_text("")
    result = run_script(
        app, f"hydra.run.dir={tmp_path / 'afile' / 'out'}", cwd=tmp_path, env=app_env
    )
    assert result.returncode == USAGE_ERROR, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"{app}: error: cannot make Hydra's output folder")
    assert str(tmp_path / "afile" / "out") in line and "hydra.run.dir=PATH" in line
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("app", ["pcframe-run", "pcframe-sim", "pcframe-tune"])
def test_an_output_folder_hydra_cannot_write_in_is_one_line(tmp_path, app_env, app):
    """A hydra.run.dir that exists but cannot be written (read-only; here its log file's
    name is taken by a folder, which refuses the write even to root) was a raw traceback of
    logging's "ValueError: Unable to configure handler 'file'", reported as a bug."""
    out = tmp_path / "out"
    (out / "job.log").mkdir(parents=True)  # Hydra's log file: <hydra.job.name>.log
    result = run_script(
        app, "hydra.job.name=job", f"hydra.run.dir={out}", cwd=tmp_path, env=app_env
    )
    assert result.returncode == USAGE_ERROR, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"{app}: error: Hydra cannot write {out / 'job.log'}: ")
    assert "hydra.run.dir=PATH" in line and "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs here: nothing to refuse")
def test_kernels_the_machine_cannot_run_are_refused_before_any_step(tmp_path, app_env):
    """kernels=triton without a GPU (nor Triton's interpreter) was refused only after the
    warm-up and the run without checkpoints had trained."""
    env = {k: v for k, v in app_env.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "out"
    result = run_script(
        "pcframe-run", "kernels=triton", "steps=3", f"hydra.run.dir={out}", cwd=tmp_path, env=env
    )
    assert result.returncode == USAGE_ERROR, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert "copy_backend='triton' cannot run on this machine" in line
    assert result.stdout == "" and not (out / "checkpoints").exists()


class _RaisingPolicy:
    """A plugin policy whose decide fails (a bug of the plugin's, not pcframe's)."""

    def decide(self, ctx):
        raise RuntimeError("boom in decide")


def test_an_error_raised_in_a_plugins_code_is_one_line_naming_its_method():
    """It printed a long traceback and "unexpected error (a bug: please report it)",
    blaming pcframe for a plugin's bug."""
    from pcframe.policies import FixedSteps
    from pcframe.sim import JobSpec, simulate, steady_trace

    class Plugin(FixedSteps, _RaisingPolicy):
        decide = _RaisingPolicy.decide

    with pytest.raises(RuntimeError) as info:
        simulate(steady_trace(1.0), Plugin(10), JobSpec())
    code, text = describe_error(info.value, "sim")
    assert code == 1 and text is not None
    assert "_RaisingPolicy.decide" in text and "raised RuntimeError: boom in decide" in text
    assert "plugin" in text and __file__ in text


def test_pcframe_code_a_plugin_calls_that_fails_is_still_reported_as_a_bug(monkeypatch):
    """A plugin calling super().decide() was blamed for a failure deep in pcframe's own
    code, and pcframe's traceback hidden."""
    from pcframe.policies import PolicyContext, Young
    from pcframe.policies.periodic import SecondsIntervalPolicy

    def broken(self, ctx):
        return {}["a pcframe bug"]

    monkeypatch.setattr(SecondsIntervalPolicy, "interval", broken)

    class Plugin(Young):
        def decide(self, ctx):
            return super().decide(ctx)

    with pytest.raises(KeyError) as info:
        _call_from_pcframe(Plugin(), PolicyContext(step=1, now=1.0))
    assert describe_error(info.value, "sim") == (1, None)


def _call_from_pcframe(policy, ctx):
    """``policy.decide(ctx)`` from a frame whose module is pcframe's (as the engine calls)."""
    from pcframe.policies import periodic

    code = compile(
        "def ask(policy, ctx):\n    return policy.decide(ctx)\n", periodic.__file__, "exec"
    )
    space: dict = {}
    exec(code, vars(periodic), space)
    return space["ask"](policy, ctx)


def test_an_error_pcframe_raises_itself_is_still_reported_as_a_bug():
    from pcframe.format.names import version_name

    with pytest.raises(ValueError) as info:
        version_name("12")  # raised inside pcframe, no plugin on the way
    assert describe_error(info.value, "sim") == (1, None)
