"""What a model's ``load_state_dict`` sees: module versions and load pre-hooks.

torch lets a module migrate state saved by older code in two ways, and a restore honours
both, as ``torch.save`` + ``load_state_dict`` would:

* **versions**: ``state_dict()`` records each module's class ``_version`` in the dict's
  ``_metadata``, and the module's ``_load_from_state_dict`` (and its pre-hooks) read it back
  as ``local_metadata["version"]`` to tell an old layout from the current one. A version
  stores the entries that differ from torch's default (``model_versions``:
  :func:`versions_to_save`) and :func:`with_versions` puts them back before the load. A
  checkpoint without them (written before pcframe kept them) loads with no metadata, as
  before: ``version`` is ``None``, which torch's own modules read as "current or older".
* **load pre-hooks** (``register_load_state_dict_pre_hook``): they may rename, add or drop
  keys (``gamma`` → ``weight``) before the module copies its tensors. The restore compares
  the checkpoint's keys with the model's *after* them (:func:`as_loaded`), so a checkpoint a
  plain ``load_state_dict`` accepts is not refused. The hooks run on a copy of the dict
  here; a complete load hands ``load_state_dict`` the saved dict, where they run once more
  (a hook that changes tensors in place, rather than the dict, would do so twice), and a
  partial one the values that fit, already migrated, with the hooks held off
  (:func:`load_pre_hooks_held`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# What state_dict() records for a module that does not set _version itself.
_DEFAULT = {"version": torch.nn.Module._version}
_EXTRA_STATE = "_extra_state"  # the key suffix of a module's get_extra_state()


def versions_to_save(state: Any) -> dict[str, dict[str, Any]] | None:
    """The ``_metadata`` entries of a ``state_dict()`` that differ from the default (``None``:
    the dict has none). Plain data only: an entry a custom hook filled with anything else is
    left out, since the version's tree holds JSON-like values."""
    metadata = getattr(state, "_metadata", None)
    if not isinstance(metadata, dict):
        return None
    return {
        prefix: dict(entry)
        for prefix, entry in metadata.items()
        if isinstance(entry, dict)
        and entry != _DEFAULT
        and all(isinstance(v, (int, float, str, bool)) for v in entry.values())
    }


def module_metadata(model: torch.nn.Module, saved: Any) -> dict[str, dict[str, Any]] | None:
    """The ``_metadata`` a ``load_state_dict`` of the saved state gets: the default for each
    of the model's modules, then what the version stored (``None``: it stored nothing)."""
    if not isinstance(saved, dict):
        return None
    metadata = {name: dict(_DEFAULT) for name, _ in model.named_modules()}
    metadata.update({str(k): dict(v) for k, v in saved.items() if isinstance(v, dict)})
    return metadata


def with_versions(state: dict[str, Any], metadata: dict[str, dict[str, Any]] | None) -> Any:
    """``state`` as an ordered dict carrying ``metadata`` the way ``state_dict()`` does."""
    if metadata is None:
        return state
    carried: OrderedDict[str, Any] = OrderedDict(state)
    carried._metadata = metadata  # type: ignore[attr-defined]
    return carried


@dataclass
class Loaded:
    """The keys a ``load_state_dict`` would load once every pre-hook ran: ``state`` (key →
    value, for the model's parameters, persistent buffers and extra states) and
    ``unexpected`` (keys no module takes)."""

    state: dict[str, Any]
    unexpected: list[str]


def has_load_pre_hooks(model: torch.nn.Module) -> bool:
    return any(module._load_state_dict_pre_hooks for module in model.modules())


def as_loaded(
    model: torch.nn.Module, saved: dict[str, Any], metadata: dict[str, dict[str, Any]] | None
) -> Loaded:
    """Run the model's load pre-hooks on a copy of ``saved`` as ``load_state_dict`` would
    (each module on the keys under its prefix, its parent's hooks first) and sort the keys
    the way torch does. A hook that raises propagates (the caller reports it)."""
    state: dict[str, Any] = {}
    unexpected: list[str] = []

    def walk(module: torch.nn.Module, local: dict[str, Any], prefix: str) -> None:
        local_metadata = dict((metadata or {}).get(prefix[:-1], {}))
        for hook in module._load_state_dict_pre_hooks.values():
            # (state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
            # the lists are torch's to fill during the real load; only the dict matters here.
            hook(local, prefix, local_metadata, True, [], [], [])
        own = {name for name, p in module._parameters.items() if p is not None}
        own |= {
            name
            for name, b in module._buffers.items()
            if b is not None and name not in module._non_persistent_buffers_set
        }
        extra = type(module).get_extra_state is not torch.nn.Module.get_extra_state
        for key, value in local.items():
            if not key.startswith(prefix):
                continue
            head, dot, _ = key[len(prefix) :].partition(".")
            if head == _EXTRA_STATE and not dot:
                if extra:  # torch never counts an extra state as unexpected
                    state[key] = value
            elif dot:
                if head not in module._modules:
                    unexpected.append(key)
            elif head in own:
                state[key] = value
            else:
                unexpected.append(key)
        for name, child in module._modules.items():
            if child is not None:
                inner = f"{prefix}{name}."
                walk(child, {k: v for k, v in local.items() if k.startswith(inner)}, inner)

    walk(model, dict(saved), "")
    return Loaded(state, unexpected)


@contextlib.contextmanager
def load_pre_hooks_held(model: torch.nn.Module) -> Iterator[None]:
    """Every module's load pre-hooks removed for the duration (a state already migrated by
    :func:`as_loaded` is loaded as it is), put back after, whatever happens."""
    held = [(m, dict(m._load_state_dict_pre_hooks)) for m in model.modules()]
    try:
        for module, _ in held:
            module._load_state_dict_pre_hooks.clear()
        yield
    finally:
        for module, hooks in held:
            module._load_state_dict_pre_hooks.update(hooks)
