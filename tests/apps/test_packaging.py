"""conf/ ships inside the wheel, and the apps compose from a non-editable install."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.apps.conftest import CONF

REPO = CONF.parent
SOURCES = ("pyproject.toml", "setup.py", "README.md", "pcframe", "policies", "kernels", "conf")

# Run with the wheel's copy of pcframe: drop the editable install's import hook first.
PROBE = """
import sys
sys.meta_path = [f for f in sys.meta_path if "__editable__" not in type(f).__module__]
sys.path_hooks = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
sys.path.insert(0, sys.argv[1])
import pcframe, pcframe.conf
assert pcframe.__file__.startswith(sys.argv[1]), pcframe.__file__
from pcframe.apps.compose import compose_config
run = compose_config("run", ["experiment=smoke", "engine=serial", "storage.directory=x"])
assert run.failure.kind == "trace" and run.engine.max_in_flight == 1
tune = compose_config("tune", ["tune=multi", "storage.directory=x"])
assert list(tune.tune.objectives) == ["stall", "memory"]
import importlib, pkgutil
for module in pkgutil.walk_packages(pcframe.__path__, "pcframe."):  # every module imports
    if not module.name.startswith(("pcframe.integrations", "pcframe.kernels.triton")):
        importlib.import_module(module.name)
import pcframe.runtime.threads, pcframe.state.apply
assert pcframe.state.apply.__file__.startswith(sys.argv[1]), pcframe.state.apply.__file__
print("composed from", pcframe.conf.__file__)
"""


@pytest.mark.slow
def test_wheel_ships_every_config_and_the_apps_compose_from_it(tmp_path, child_env):
    source = tmp_path / "src"  # build from a copy: setuptools writes build/ into the tree
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(src, source / name)
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
         "--no-build-isolation", "-q", "-w", str(wheels)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("pcframe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"pcframe/conf/{p.relative_to(CONF).as_posix()}" for p in CONF.rglob("*.yaml")}
    assert expected and expected <= names, sorted(expected - names)

    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)  # what pip install puts in site-packages
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(target)],
        cwd=tmp_path,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    assert str(target) in probe.stdout


@pytest.mark.slow
def test_the_kernels_folder_is_no_top_level_kernels_from_the_repository_root(child_env):
    """A script run from the repository's root finds Hugging Face's ``kernels`` (which
    transformers imports when it is installed), not this repository's ``kernels/``
    folder; without it, ``import kernels`` fails as if the folder were not there."""
    probe = "import kernels; print(kernels.__file__)"
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=child_env, capture_output=True, text=True
    )
    assert found.returncode == 0, found.stderr
    assert not found.stdout.strip().startswith(str(REPO / "kernels")), found.stdout
    hub = "import transformers.integrations.hub_kernels; import pcframe.kernels as k; k.gather"
    both = subprocess.run(
        [sys.executable, "-c", hub], cwd=REPO, env=child_env, capture_output=True, text=True
    )
    assert both.returncode == 0, both.stderr[-2000:]
    # No other package named kernels on the path (-S: no site-packages).
    alone = subprocess.run(
        [sys.executable, "-S", "-c", probe], cwd=REPO, env=child_env, capture_output=True, text=True
    )
    assert alone.returncode == 1 and "No module named 'kernels'" in alone.stderr, alone.stderr


def test_every_source_folder_is_a_package_the_wheel_ships():
    """setup.py finds packages by their __init__.py: pcframe/runtime and pcframe/state had
    none, so a non-editable install lacked them and `import pcframe` failed there (the
    editable install in development hid it)."""
    folders = {
        path.parent
        for root in ("pcframe", "policies", "kernels")
        for path in (REPO / root).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    missing = sorted(str(f.relative_to(REPO)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"add an __init__.py to: {missing}"
