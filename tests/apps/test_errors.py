"""Configuration mistakes end the real console scripts with one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, OverrideParseException

from pcframe.apps.compose import engine_config
from pcframe.apps.errors import USAGE_ERROR, describe_error
from pcframe.errors import ConfigError
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
    ],
    ids=str,
)
def test_a_bad_override_is_one_line_and_exit_code_2(tmp_path, app_env, override, key, fix):
    result = run_script(
        "pcframe-run", override, f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path, env=app_env
    )
    assert result.returncode == USAGE_ERROR, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pcframe-run: error: ") and key in lines[0] and fix in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


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
    ],
    ids=str,
)
def test_every_composition_error_is_described_in_one_line(overrides, tmp_path):
    with pytest.raises((ConfigCompositionException, OverrideParseException, ConfigError)) as info:
        compose("run", *overrides, directory=tmp_path)
    code, text = describe_error(info.value)
    assert code == USAGE_ERROR and text and "\n" not in text
    assert overrides[-1].split("=")[0].lstrip("+") in text


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
