"""The example plugin package installs with pip and is found through its entry point."""

from __future__ import annotations

import importlib.metadata
import importlib.util
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


def test_the_plugins_own_suite_passes_with_the_conformance_kit(installed: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=EXAMPLE.parents[1],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in done.stdout and "failed" not in done.stdout
