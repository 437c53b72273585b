"""Dataclass schemas registered in Hydra's ConfigStore so bad keys fail at compose time."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from pcframe.config import EngineConfig


def register() -> None:
    store = ConfigStore.instance()
    store.store(group="engine", name="engine_schema", node=EngineConfig)
