"""Entry-point policies are config options of the apps, without any YAML.

The real install of the example plugin and a real ``pcframe-run`` / ``pcframe-sim`` with it
are in tests/policies/test_example_plugin.py. Here: the generated node, and what happens
with a plugin that needs an argument and one whose import fails, declared through a
temporary ``*.dist-info/entry_points.txt`` on a child's ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pcframe.apps.errors import USAGE_ERROR
from pcframe.apps.instantiate import check_targets
from pcframe.apps.plugins import GROUPS, target_node
from pcframe.errors import ConfigError
from pcframe.policies import Decision, IntervalPolicy, PolicyContext


class _Needs(IntervalPolicy):
    name = "needs_every"

    def __init__(self, every: int, scale: float = 1.5, tiers: tuple = ("local",), note=None):
        self.every, self.scale, self.tiers, self.note = every, scale, tiers, note

    def decide(self, ctx: PolicyContext) -> Decision:
        return Decision(ctx.step > 0 and ctx.step % self.every == 0)


def test_the_generated_node_is_the_constructor() -> None:
    node = target_node(_Needs)
    assert node["_target_"] == f"{__name__}._Needs"
    assert node["scale"] == 1.5 and node["note"] is None
    assert node["every"] == "???"  # required: must be given
    assert "tiers" not in node  # not a plain value: left to the constructor's default
    assert GROUPS["interval"] == "policy/interval"


def test_a_required_argument_left_at_missing_is_reported_with_the_key() -> None:
    cfg = OmegaConf.create({"policy": {"interval": target_node(_Needs)}})
    with pytest.raises(ConfigError, match=r"needs every; add policy\.interval\.every=\.\.\."):
        check_targets(cfg)
    cfg.policy.interval.every = 4
    check_targets(cfg)  # given: fine
    cfg.policy.interval.every = "four"
    with pytest.raises(ConfigError, match=r"policy\.interval\.every='four' has the wrong type"):
        check_targets(cfg)


PLUGIN = """
from pcframe.policies import Decision, IntervalPolicy


class NeedsEvery(IntervalPolicy):
    name = "needs_every"

    def __init__(self, every: int, scale: float = 1.0) -> None:
        self.every = every

    def decide(self, ctx):
        return Decision(ctx.step > 0 and ctx.step % self.every == 0)
"""


@pytest.fixture
def plugin_path(tmp_path: Path) -> Path:
    """A folder that, on ``PYTHONPATH``, makes two entry points visible: a working policy
    with a required argument and one whose module does not exist."""
    site = tmp_path / "site"
    info = site / "fake_pcframe_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "fake_pcframe_plugin.py").write_text(PLUGIN)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fake-pcframe-plugin\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [pcframe.policies]
            needs_every = fake_pcframe_plugin:NeedsEvery
            broken_policy = no_such_module_here:Policy
            """
        )
    )
    return site


def _run(*args: str, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("pcframe-run")
    assert exe.exists(), "pcframe-run is not installed: pip install -e . --no-deps"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PCFRAME_CONFIG_DIR": str(cwd / "user-conf")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [str(exe), f"hydra.run.dir={cwd / 'out'}", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_a_required_plugin_argument_and_a_broken_plugin(plugin_path: Path, tmp_path: Path):
    # A broken plugin does not break the app for anyone not asking for it.
    shown = _run("policy/interval=needs_every", "--cfg", "job", site=plugin_path, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "_target_: fake_pcframe_plugin.NeedsEvery" in shown.stdout
    assert "every: ???" in shown.stdout and "scale: 1.0" in shown.stdout

    needs = _run("policy/interval=needs_every", site=plugin_path, cwd=tmp_path)
    assert needs.returncode == USAGE_ERROR, needs.stdout + needs.stderr
    (line,) = needs.stderr.strip().splitlines()
    assert "needs every; add policy.interval.every=..." in line, line

    broken = _run("policy/interval=broken_policy", site=plugin_path, cwd=tmp_path)
    assert broken.returncode == USAGE_ERROR, broken.stdout + broken.stderr
    (line,) = broken.stderr.strip().splitlines()
    assert line.startswith("pcframe-run: error: policy/interval=broken_policy: no such option")
    assert "installed but failed" in line and "no_such_module_here" in line, line
