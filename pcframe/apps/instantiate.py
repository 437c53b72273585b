"""Check ``_target_`` nodes against their callables before anything is instantiated.

The policy configs are plain ``_target_`` + keyword YAML (their schema is the constructor).
Hydra would only notice a misspelt keyword when the object is built, deep into a run, with
a ``TypeError`` that does not name the config key. This check runs right after composing
and names the key, the parameters that exist and the fix.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import re
import types
import typing
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from pcframe.errors import ConfigError
from pcframe.policies.registry import accepted_keywords

_HYDRA_KEYS = {"_target_", "_args_", "_recursive_", "_convert_", "_partial_"}
_PLAIN = (bool, int, float, str)


def locate(target: str) -> Any:
    """``hydra.utils.get_object(target)`` without the ERROR line it logs when the import fails.

    Hydra logs that line (through the job's console handler) before re-raising; the callers
    here report the failure themselves, in one line, so Hydra's lines would only precede it.
    """
    logger = logging.getLogger("hydra.utils")
    was = logger.disabled
    logger.disabled = True
    try:
        return get_object(target)
    finally:
        logger.disabled = was


def build(node: DictConfig, where: str) -> Any:
    """``instantiate(node)``; a value the constructor refuses is a :class:`ConfigError`
    naming the key (``policy.interval.every=0``) instead of Hydra's "Error in call to target".

    Called before training starts, so a bad policy argument does not wait for the warm-up.
    """
    try:
        return instantiate(node)
    except InstantiationException as exc:
        cause = exc.__cause__
        if not isinstance(cause, ValueError | TypeError):
            raise
        raise ConfigError(_refused(node, where, str(exc), cause)) from None


def _refused(node: DictConfig, where: str, text: str, cause: Exception) -> str:
    # Hydra's message ends with the full key of the (possibly nested) node that failed.
    found = re.search(r"full_key: (\S+)", text)
    path = found.group(1) if found and found.group(1).startswith(where) else where
    relative = path[len(where) + 1 :]
    sub = OmegaConf.select(node, relative) if relative else node
    reason = " ".join(str(cause).split())
    keys = [str(k) for k in sub if str(k) not in _HYDRA_KEYS] if isinstance(sub, DictConfig) else []
    for key in keys:  # the constructors' messages say ``name=value``: that names the key
        if re.search(rf"(?<![\w.]){re.escape(key)}=", reason):
            value = sub._get_node(key)._value()
            return f"{path}.{key}={value!r} is invalid: {reason}"
    target = sub.get("_target_", "?") if isinstance(sub, DictConfig) else "?"
    return f"{path}: {target} refused its arguments: {reason}; fix the keys of {path}"


def check_targets(cfg: DictConfig, path: str = "") -> None:
    """Raise :class:`ConfigError` for the first ``_target_`` node that cannot be built.

    Checks that the target imports, that every key is a parameter, that required parameters
    are given, and that plain values (numbers, strings, booleans) have the annotated type.
    """
    if cfg._is_none() or cfg._is_missing() or cfg._is_interpolation():
        return
    if isinstance(cfg, DictConfig):
        if "_target_" in cfg:
            _check_node(cfg, path)
        for key in cfg:
            if path == "" and key == "hydra":
                continue
            child = cfg._get_node(key)
            if isinstance(child, DictConfig | ListConfig):
                check_targets(child, f"{path}.{key}" if path else str(key))
    elif isinstance(cfg, ListConfig):
        for index, child in enumerate(cfg._iter_ex(resolve=False)):
            if isinstance(child, DictConfig | ListConfig):
                check_targets(child, f"{path}[{index}]")


def _check_node(node: DictConfig, path: str) -> None:
    target = node._get_node("_target_")._value()
    where = path or "<root>"
    try:
        obj = locate(target)
    except Exception as exc:
        # Hydra wraps the import's own error in several lines of its wording: name the cause.
        root = exc.__cause__ or exc
        raise ConfigError(
            f"{where}._target_={target!r} cannot be imported ({type(root).__name__}: {root}); "
            "fix the dotted path or install the package that provides it"
        ) from None
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # builtins without a signature: nothing to check here
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {
        name: p
        for name, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    keys = [str(k) for k in node if str(k) not in _HYDRA_KEYS]
    accepted = set(named) if not takes_any else accepted_keywords(obj)
    if accepted is not None:
        named_all = sorted(accepted) if takes_any else list(named)
        for key in keys:
            if key not in accepted:
                near = difflib.get_close_matches(key, named_all, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ConfigError(
                    f"{where}.{key}: {target} has no parameter {key!r}{hint}; "
                    f"it takes: {', '.join(named_all) or 'no arguments'}. Fix or remove the key"
                )
    # A ``???`` value (a required argument of a generated plugin config) is not given.
    given = [k for k in keys if not OmegaConf.is_missing(node, k)]
    if not node.get("_partial_", False) and "_args_" not in node:
        missing = [n for n, p in named.items() if p.default is p.empty and n not in given]
        if missing:
            raise ConfigError(
                f"{where}: {target} needs {', '.join(missing)}; add "
                + ", ".join(f"{where}.{m}=..." for m in missing)
            )
    hints = _hints(obj)
    for key in given:
        if key in hints and not OmegaConf.is_interpolation(node, key):
            value = node._get_node(key)._value()
            if not _fits(value, hints[key]):
                raise ConfigError(
                    f"{where}.{key}={value!r} has the wrong type: {target} expects "
                    f"{_name(hints[key])}; give a value of that type"
                )


def _hints(obj: Any) -> dict[str, Any]:
    func = obj.__init__ if inspect.isclass(obj) else obj
    try:
        return typing.get_type_hints(func)
    except Exception:
        return {}  # unresolvable forward references: skip the type check, keep the key check


def _fits(value: Any, annotation: Any) -> bool:
    """Whether a plain config value fits ``annotation``; unknown annotations always fit."""
    options = _union_members(annotation)
    if options is None:
        options = (annotation,)
    if value is None:
        return type(None) in options or not all(o in _PLAIN for o in options)
    if not all(o in (*_PLAIN, type(None)) for o in options):
        return True  # containers, objects, Literals...: left to the callable
    if isinstance(value, bool):
        return bool in options
    if isinstance(value, int):
        return int in options or float in options
    return type(value) in options


def _union_members(annotation: Any) -> tuple[Any, ...] | None:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return None


def _name(annotation: Any) -> str:
    options = _union_members(annotation) or (annotation,)
    return " or ".join(
        "null" if o is type(None) else getattr(o, "__name__", str(o)) for o in options
    )
