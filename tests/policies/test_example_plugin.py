"""The example plugin package installs with pip and is found through its entry point."""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.version import Version

import pcframe.policies as P
from pcframe.policies.registry import REGISTRY

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pcframe-example-policy"


def _local_backend_builds_wheels() -> bool:
    """Whether this environment's setuptools can build a wheel without downloading anything
    (setuptools >= 70.1 has bdist_wheel built in; older ones need the ``wheel`` package)."""
    try:
        have = Version(importlib.metadata.version("setuptools"))
    except importlib.metadata.PackageNotFoundError:
        return False
    return have >= Version("70.1") or importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``pip install`` the example into a throw-away target directory (no deps).

    Offline with the environment's own setuptools when it can build wheels (seconds); else
    with pip's usual isolated build, which fetches setuptools from the package index. The
    source is copied first so that the build leaves nothing behind in the repository.
    """
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed in this environment")
    work = tmp_path_factory.mktemp("plugin")
    skip = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    src = shutil.copytree(EXAMPLE, work / "src", ignore=skip)
    target = work / "site"
    offline = _local_backend_builds_wheels()
    flags = ["--no-build-isolation", "--no-index"] if offline else []
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *flags]
    cmd += ["--disable-pip-version-check", "-q", "--target", str(target), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if done.returncode != 0 and not offline:
        pytest.skip(
            "cannot build the example plugin here: the local setuptools cannot build wheels "
            f"and the package index is unreachable ({done.stderr.strip()[-300:]})"
        )
    assert done.returncode == 0, done.stderr
    sys.path.insert(0, str(target))
    REGISTRY.refresh()
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        REGISTRY.unregister("steps_or_seconds")
        for name in [m for m in sys.modules if m.startswith("pcframe_example_policy")]:
            del sys.modules[name]
        REGISTRY.refresh()


def test_found_by_name_through_the_entry_point(installed: Path) -> None:
    assert (installed / "pcframe_example_policy").is_dir()
    assert "steps_or_seconds" in P.available()
    cls = P.get("steps_or_seconds")
    assert cls.__module__ == "pcframe_example_policy.policy"
    assert "steps_or_seconds" in P.available("interval")
    policy = P.create("steps_or_seconds", steps=3, seconds=1e9)
    saves = [s for s in range(10) if policy.decide(P.PolicyContext(step=s, now=float(s))).save]
    assert saves == [3, 6, 9]


@pytest.mark.slow
def test_the_plugins_own_suite_passes_with_the_conformance_kit(installed: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), *sys.path])}
    done = subprocess.run(
        # -n 0: the repository's pytest options (found from cwd) would start xdist workers
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            str(EXAMPLE / "tests"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=EXAMPLE.parents[1],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in done.stdout and "failed" not in done.stdout


def _app(name: str, *args: str, target: Path, cwd: Path) -> subprocess.CompletedProcess:
    """The installed console script ``name``, with the plugin's install folder importable
    (as a ``pip install`` into the environment would make it)."""
    exe = Path(sys.executable).with_name(name)
    assert exe.exists(), f"{name} is not installed: pip install -e . --no-deps"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PCFRAME_CONFIG_DIR": str(cwd / "user-conf")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_pcframe_run_selects_the_plugin_by_name_with_its_arguments(installed: Path, tmp_path):
    """No YAML anywhere: the entry-point name is a ``policy/interval`` option of the apps."""
    out = tmp_path / "out"
    done = _app(
        "pcframe-run",
        "policy/interval=steps_or_seconds",
        "policy.interval.steps=5",  # a constructor argument, overridden like a built-in's
        "steps=30",
        "workload=tiny",
        "baseline=false",
        "progress=false",
        f"hydra.run.dir={out}",
        target=installed,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["policy"] == "StepsOrSeconds(steps=5, seconds=900)", summary
    assert summary["checkpoints"] >= 5, summary  # every 5 of 30 steps
    assert "StepsOrSeconds(steps=5" in done.stdout
    assert not (
        EXAMPLE.parents[1] / "conf" / "policy" / "interval" / "steps_or_seconds.yaml"
    ).exists()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "+policy.interval.stepz=5",
            "StepsOrSeconds has no parameter 'stepz' (did you mean 'steps'?); it takes: steps",
        ),
        ("policy.interval.stepz=5", "did you mean policy.interval.steps?"),
        ("policy.interval.steps=abc", "policy.interval.steps='abc' has the wrong type"),
    ],
    ids=str,
)
def test_a_wrong_plugin_argument_is_one_line_and_exit_code_2(
    installed: Path, tmp_path: Path, override: str, expected: str
) -> None:
    done = _app(
        "pcframe-run",
        "policy/interval=steps_or_seconds",
        override,
        f"hydra.run.dir={tmp_path / 'out'}",
        target=installed,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("pcframe-run: error: ") and expected in line, line
    assert done.stdout == ""


@pytest.mark.slow
def test_pcframe_sim_and_help_know_the_plugin(installed: Path, tmp_path: Path) -> None:
    from pcframe.policies.traces import shared_traces_dir

    traces = shared_traces_dir()
    if traces is None or not (traces / "pccheck" / "gpus_trace.csv").is_file():
        pytest.skip("the shipped PCcheck trace is not in this checkout")
    helped = _app("pcframe-sim", "--help", target=installed, cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    interval = next(
        x for x in helped.stdout.splitlines() if x.strip().startswith("policy/interval:")
    )
    assert "steps_or_seconds" in interval and "daly" in interval
    out = tmp_path / "sim"
    done = _app(
        "pcframe-sim",
        "policy/interval=steps_or_seconds",
        "policy.interval.steps=50",
        "traces=pccheck/gpus_trace.csv",
        "baselines=[]",
        "output.plots=false",
        "progress=false",
        f"hydra.run.dir={out}",
        target=installed,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and {r["label"] for r in rows} == {"StepsOrSeconds"}, rows
