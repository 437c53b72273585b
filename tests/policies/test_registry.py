"""The name registry and entry-point discovery (with throw-away installed distributions)."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import pcframe.policies as P
from pcframe.policies import Registry
from pcframe.policies.errors import PluginError
from pcframe.policies.registry import ENTRY_POINT_GROUP

SHIPPED = {
    "interval": {
        "fixed_steps",
        "fixed_time",
        "young",
        "daly",
        "overhead_budget",
        "checkfreq",
        "preemption_aware",
        "notice",
    },
    "placement": {"single_tier", "memory_then_disk", "local_plus_remote", "peers_then_remote"},
    "resource": {"spot_only", "on_demand_only", "hybrid_availability", "uniform_progress"},
    "predictor": {"poisson_window", "ewma", "hazard_tod", "gamma_poisson"},
    "notice_source": {"signal", "file", "metadata_url", "manual"},
}


def test_every_shipped_policy_is_registered_by_kind() -> None:
    for kind, names in SHIPPED.items():
        assert names <= set(P.available(kind)), kind
    assert P.get("daly") is P.Daly
    policy = P.create("fixed_steps", every=7)
    assert isinstance(policy, P.FixedSteps) and policy.every == 7
    with pytest.raises(ValueError, match="kind"):
        P.available("nonsense")


def test_duplicate_name_raises() -> None:
    reg = Registry(group=None)
    reg.register("mine", P.FixedSteps)
    reg.register("mine", P.FixedSteps)  # the same class again is harmless
    with pytest.raises(ValueError, match="already registered"):
        reg.register("mine", P.FixedTime)
    reg.register("mine", P.FixedTime, replace=True)
    assert reg.get("mine") is P.FixedTime
    with pytest.raises(ValueError, match="already registered"):
        P.register("daly")(P.Young)  # the global registry guards built-in names too


def test_unknown_name_and_non_policy_classes() -> None:
    reg = Registry(group=None)
    reg.register("a", P.FixedSteps)
    with pytest.raises(KeyError, match="available: a"):
        reg.get("b")
    with pytest.raises(TypeError, match="not a subclass"):
        reg.register("x", dict)
    with pytest.raises(ValueError, match="non-empty"):
        reg.register("", P.FixedSteps)


def test_decorator_registers_under_the_class_name() -> None:
    @P.register()
    class Every3(P.FixedSteps):
        name = "test_every3"

        def __init__(self) -> None:
            super().__init__(3)

    try:
        assert P.get("test_every3") is Every3
        assert "test_every3" in P.available("interval")
    finally:
        P.registry.REGISTRY.unregister("test_every3")
    assert "test_every3" not in P.available()


def _install_fake(root: Path, dist: str, module: str, entries: dict[str, str], code: str) -> None:
    """A minimal installed distribution: a module plus dist-info with entry points."""
    (root / f"{module}.py").write_text(textwrap.dedent(code))
    # Wheel naming: '-' in the project name becomes '_' (else every "fake-x" reads as "fake").
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("fake_"):
            del sys.modules[name]


GOOD = """
from pcframe.policies import Decision, IntervalPolicy
IMPORTED = True
class Never(IntervalPolicy):
    name = "never"
    def decide(self, ctx):
        return Decision(False)
"""


def test_entry_points_are_discovered_lazily(site: Path) -> None:
    _install_fake(site, "fake-good", "fake_good", {"fake_never": "fake_good:Never"}, GOOD)
    reg = Registry()
    assert "fake_never" in reg.available()
    assert "fake_good" not in sys.modules  # listed without importing the plugin
    cls = reg.get("fake_never")
    assert cls.__name__ == "Never" and "fake_never" in reg.available("interval")


def test_broken_plugin_is_reported_by_name(site: Path) -> None:
    _install_fake(
        site,
        "fake-broken",
        "fake_broken",
        {"fake_oops": "fake_broken:Gone"},
        "raise ImportError('missing dependency foo')\n",
    )
    _install_fake(site, "fake-notapolicy", "fake_np", {"fake_np": "fake_np:X"}, "X = 1\n")
    reg = Registry()
    with pytest.raises(PluginError, match=r"fake_oops.*missing dependency foo"):
        reg.get("fake_oops")
    with pytest.raises(PluginError, match=r"fake_np.*not a subclass"):
        reg.get("fake_np")
    assert reg.available() == ["fake_np", "fake_oops"]  # still listed, still named


def test_a_plugin_that_exits_while_imported_is_a_broken_plugin(site: Path) -> None:
    """A plugin module that parses the command line at import (argparse: the app's Hydra
    overrides are not its flags) or calls sys.exit raised SystemExit through ``get``: every
    app, which imports each installed plugin at start-up, exited with the plugin's usage
    line, even when that plugin was not asked for. Now it is a broken plugin, named."""
    _install_fake(
        site,
        "fake-argv",
        "fake_argv",
        {"fake_argv": "fake_argv:Never"},
        "import argparse\nargparse.ArgumentParser().parse_args(['--no-such-flag'])\n" + GOOD,
    )
    _install_fake(
        site,
        "fake-exits",
        "fake_exits",
        {"fake_exits": "fake_exits:Never"},
        "raise SystemExit(3)\n",
    )
    reg = Registry()
    with pytest.raises(PluginError, match=r"fake_argv.*SystemExit"):
        reg.get("fake_argv")
    with pytest.raises(PluginError, match=r"fake_exits.*SystemExit"):
        reg.get("fake_exits")


def test_entry_point_clashing_with_a_builtin_raises(site: Path) -> None:
    _install_fake(site, "fake-clash", "fake_clash", {"daly": "fake_clash:Never"}, GOOD)
    reg = Registry()
    reg.register("daly", P.Daly)
    with pytest.raises(ValueError, match="clashes"):
        reg.get("daly")


def test_refresh_sees_a_plugin_installed_later(site: Path) -> None:
    reg = Registry()
    assert "fake_late" not in reg.available()
    _install_fake(site, "fake-late", "fake_late", {"fake_late": "fake_late:Never"}, GOOD)
    reg.refresh()
    assert "fake_late" in reg.available()


def test_a_misspelt_argument_names_the_plugin_and_the_nearest_argument():
    """Young passes **kw to its base class: the TypeError named SecondsIntervalPolicy."""
    with pytest.raises(TypeError, match=r"'young' \(Young\) has no argument 'mtbff' \(did you"):
        P.create("young", mtbff=5)
    assert P.create("young", mtbf=5.0).mtbf == 5.0


def test_every_type_a_plugin_writes_is_importable_from_the_package() -> None:
    """docs/policies.md has an interval policy's save_hint return a SaveHint, yet
    `from pcframe.policies import SaveHint` failed: a plugin had to know it was in .base."""
    import pcframe.policies as P

    for name in ("Decision", "PolicyContext", "SaveHint", "SaveCompleted", "Restarted"):
        assert name in P.__all__ and getattr(P, name).__module__ == "pcframe.policies.base"
