"""Every registered policy is a config option, plugins included, without writing YAML.

The shipped policies have a YAML each under ``conf/policy/<kind>/``. A policy installed
through the ``pcframe.policies`` entry point (or registered with ``@register`` in an imported
module) has none, so :func:`register_policy_configs` stores a node in Hydra's ConfigStore for
every registry name that has no YAML of that name: ``_target_`` pointing to the class, and
its constructor arguments with their defaults (required ones as ``???``). Then

    pcframe-run policy/interval=steps_or_seconds policy.interval.steps=50
    pcframe-sim policy/interval=steps_or_seconds policy/resource=my_resource_policy

work like for a built-in, and :mod:`pcframe.apps.instantiate` checks the keys against the
constructor. The apps call this at start-up; ConfigStore options come after YAML files in
Hydra's search path, and a name with a YAML (shipped, or in ``$PCFRAME_CONFIG_DIR``) is
skipped altogether, so a YAML always wins.
"""

from __future__ import annotations

import importlib.resources
import inspect
import sys
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from pcframe.policies.errors import PluginError
from pcframe.policies.kinds import kind_of
from pcframe.policies.registry import REGISTRY

# registry kind -> config group (notice sources are nested inside `notice`, no group)
GROUPS = {
    "interval": "policy/interval",
    "placement": "policy/placement",
    "resource": "policy/resource",
    "predictor": "sim/predictor",
}

_PLAIN = (bool, int, float, str, type(None))

# name -> why its entry point could not be loaded (reported if that option is asked for)
_broken: dict[str, str] = {}
# (group, name) -> the stored node, so a second call stores nothing new
_stored: dict[tuple[str, str], dict[str, Any]] = {}


def broken_plugins() -> dict[str, str]:
    """``{name: error}`` of the entry points that failed to import at the last registration."""
    return dict(_broken)


def target_node(cls: type) -> dict[str, Any]:
    """``{"_target_": "module.Class", arg: default, ...}`` from the constructor's signature.

    Defaults that are plain scalars are kept (so ``policy.interval.<arg>=...`` overrides
    them without a ``+``), required arguments become ``???`` (reported by the target check
    as missing, with the key to set); other defaults (objects, containers) are left to the
    constructor (add them with ``+policy.interval.<arg>=...``).
    """
    node: dict[str, Any] = {"_target_": f"{cls.__module__}.{cls.__qualname__}"}
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return node
    for p in params:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.name.startswith("_"):
            continue
        if p.default is p.empty:
            node[p.name] = MISSING
        elif isinstance(p.default, _PLAIN):
            node[p.name] = p.default
    return node


def _has_yaml(group: str, name: str, user_dirs: list[Any]) -> bool:
    shipped = importlib.resources.files("pcframe.conf").joinpath(group, f"{name}.yaml")
    if shipped.is_file():
        return True
    return any((d / group / f"{name}.yaml").is_file() for d in user_dirs)


def register_policy_configs() -> list[tuple[str, str]]:
    """Store a config node for every registry name without a YAML; ``[(group, name)]`` stored.

    Entry points are imported here (they must be, to learn their kind); one that fails is
    skipped and remembered (:func:`broken_plugins`), so a broken plugin never breaks an app
    that does not ask for it. Idempotent; call :func:`pcframe.policies.refresh` first to
    see a plugin installed in this process.
    """
    from pcframe.apps.paths import user_config_dir

    user_dirs = [user_config_dir()]
    store = ConfigStore.instance()
    _broken.clear()
    try:
        names = REGISTRY.available()
    except ValueError as exc:  # two plugins, or a plugin and a built-in, share a name
        sys.stderr.write(f"pcframe: warning: policy plugins not loaded: {exc}\n")
        return []
    stored = []
    for name in names:
        try:
            cls = REGISTRY.get(name)
        except PluginError as exc:
            _broken[name] = str(exc)
            continue
        group = GROUPS.get(kind_of(cls))
        if group is None or _has_yaml(group, name, user_dirs):
            continue
        node = target_node(cls)
        if _stored.get((group, name)) != node:
            store.store(group=group, name=name, node=node)
            _stored[(group, name)] = node
        stored.append((group, name))
    return stored
