"""Compose the apps' configs without running them (tests, the tuner, benchmarks, notebooks)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pcframe.apps.bounds import check_bounds
from pcframe.apps.errors import APP_GROUPS, config_groups, describe_error
from pcframe.apps.instantiate import check_targets
from pcframe.apps.nulls import read_nulls, register_none_options
from pcframe.apps.schemas import register_app_schemas
from pcframe.config import EngineConfig
from pcframe.errors import ConfigError

CONFIG_MODULE = "pcframe.conf"

# The primary configs add $PCFRAME_CONFIG_DIR (default ./pcframe-conf, where pcframe-tune
# writes engine/tuned.yaml) to Hydra's search path. Hydra warns when that folder does not
# exist, which is the normal case before the first tuning run, so that one warning is muted.
_MISSING_USER_CONF = r"provider=hydra\.searchpath in main, path=.* is not available"


def quiet_missing_user_conf() -> None:
    """Mute Hydra's warning about an absent user config folder (for the console scripts)."""
    warnings.filterwarnings("ignore", message=_MISSING_USER_CONF, category=UserWarning)


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_MISSING_USER_CONF, category=UserWarning)
        yield


def compose_config(
    config_name: str, overrides: Sequence[str] = (), *, check: bool = True
) -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with ``overrides``, as the console script would.

    ``${hydra:...}`` interpolations (the default checkpoint directory) are not available
    outside a running app: override ``storage.directory`` when the result is used.
    With ``check``, every ``_target_`` node is checked against its callable's signature,
    and the numeric knobs against their ranges (:mod:`pcframe.apps.bounds`).

    Raises:
        ConfigError: one line naming the override, key or option and the fix (what the
            console scripts print), Hydra's own exception as its ``__cause__``.
    """
    register_app_schemas()
    _register_app(config_name)
    groups = APP_GROUPS.get(config_name, ())
    register_none_options(config_name, groups)
    overrides = read_nulls(overrides, config_name, groups, config_groups)
    try:
        with _quiet(), initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            cfg = compose(config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        # The line the console scripts print (the key, the options, "did you mean"), not
        # Hydra's traceback; the original stays attached as the cause.
        _, text = describe_error(exc)
        raise ConfigError(text or str(exc)) from exc
    if check:
        check_targets(cfg)
        check_bounds(cfg, config_name)
    return cfg


def _register_app(config_name: str) -> None:
    """Import ``pcframe.apps.<config_name>`` if there is one: each app module registers its
    own schemas (``pcframe-sim`` has its own) when it is imported."""
    name = f"pcframe.apps.{config_name}"
    if importlib.util.find_spec(name) is not None:
        importlib.import_module(name)


def engine_config(cfg: DictConfig) -> EngineConfig:
    """The validated engine knobs of a composed config (errors name ``engine.<key>``)."""
    values = OmegaConf.to_container(cfg.engine, resolve=True)
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(values) - known)
    if unknown:  # only reachable with a `+engine.<key>=` override: the schema has no such key
        key = unknown[0]
        close = difflib.get_close_matches(key, known, n=1)
        hint = (
            f"did you mean engine.{close[0]}?"
            if close
            else f"remove it; the engine's options are {', '.join(sorted(known))}"
        )
        raise ConfigError(f"engine.{key} is not an engine option; {hint}")
    return EngineConfig(**values)
