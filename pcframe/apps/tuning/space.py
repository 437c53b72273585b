"""The search space: engine knobs listed in ``tune.space``, suggested through an Optuna trial.

A knob is searched only if it is listed, so a new engine option (a codec, a kernel backend)
joins the search by adding one line to ``conf/tune/*.yaml``. Values become Hydra overrides
(``engine.<knob>=<value>``) and go through the same composition and validation as a command
line, so a trial's configuration is exactly what ``pcframe-run`` would build from it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Any

import optuna
from omegaconf import OmegaConf

from pcframe.config import EngineConfig
from pcframe.errors import ConfigError

TYPES = ("int", "float", "categorical")
SPEC_KEYS = ("type", "low", "high", "step", "log", "choices", "values")


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    type: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()
    values: dict[str, Any] | None = None  # named values (dicts, lists): Optuna sees the names

    def contains(self, value: Any) -> bool:
        if self.values is not None:
            return value in self.values.values()
        if self.type == "categorical":
            return value in self.choices
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        return self.low <= value <= self.high and (self.type == "float" or value == int(value))


def parse_space(space: Mapping[str, Any], fixed: set[str] = frozenset()) -> list[Knob]:
    """Validate ``tune.space`` (a mapping of knob name to spec) into :class:`Knob` s.

    Knobs set to ``null`` and knobs in ``fixed`` (pinned on the command line) are left out.
    """
    engine_keys = [f.name for f in dataclasses.fields(EngineConfig)]
    knobs = []
    for name, spec in space.items():
        if spec is None or name in fixed:
            continue
        where = f"tune.space.{name}"
        if name not in engine_keys:
            raise ConfigError(
                f"{where}: {name!r} is not an engine option (EngineConfig has "
                f"{', '.join(engine_keys)}); remove it, or add the option to the engine first"
            )
        if not isinstance(spec, Mapping):
            raise ConfigError(
                f"{where}={spec!r}: give a mapping such as {{type: int, low: 1, high: 4}}"
            )
        unknown = [str(k) for k in spec if k not in SPEC_KEYS]
        if unknown:
            raise ConfigError(
                f"{where}.{unknown[0]} is not a knob setting; use {', '.join(SPEC_KEYS)}"
            )
        kind = spec.get("type")
        if kind not in TYPES:
            raise ConfigError(f"{where}.type={kind!r} is invalid: use one of {', '.join(TYPES)}")
        if kind == "categorical":
            values = spec.get("values")
            if values is not None:
                if spec.get("choices") or not values:
                    raise ConfigError(
                        f"{where}: give either `choices` (plain values) or `values` (a "
                        "non-empty mapping of name -> value, for dicts and lists), not both"
                    )
                plain = OmegaConf.to_container if OmegaConf.is_config(values) else dict
                values = {str(k): v for k, v in plain(values).items()}
                knobs.append(Knob(name, kind, choices=tuple(values), values=values))
                continue
            choices = tuple(spec.get("choices") or ())
            if not choices:
                raise ConfigError(f"{where}: categorical needs a non-empty `choices` list")
            knobs.append(Knob(name, kind, choices=choices))
            continue
        low, high = spec.get("low"), spec.get("high")
        if low is None or high is None or not low < high:
            raise ConfigError(f"{where}: {kind} needs numbers low < high, got {low}..{high}")
        if kind == "int" and (low != int(low) or high != int(high)):
            raise ConfigError(f"{where}: int bounds must be whole numbers, got {low}..{high}")
        if spec.get("log") and low <= 0:
            raise ConfigError(f"{where}: log scale needs low > 0, got {low}")
        knobs.append(
            Knob(name, kind, low, high, spec.get("step"), bool(spec.get("log")), choices=())
        )
    if not knobs:
        raise ConfigError("tune.space lists no knob to search; add at least one engine option")
    return knobs


def check_space(knobs: list[Knob], engine: EngineConfig) -> None:
    """Refuse a knob whose range reaches a value the engine refuses whatever the other knobs
    are (each bound, each choice), before the first trial rather than in whichever trial the
    sampler sends there. A value refused only beside some values of other knobs (a staging
    budget below the largest chunk) is left to the trials, which prune such combinations."""
    candidates = {k.name: _candidates(k) for k in knobs}
    for k in knobs:
        others = [name for name in candidates if name != k.name]
        for value in candidates[k.name]:
            try:
                engine.with_overrides(**{k.name: value})
                continue
            except ConfigError as exc:
                refusal = exc
            combinations = itertools.product(*(candidates[name] for name in others))
            if any(
                _accepted(engine, {k.name: value, **dict(zip(others, combo, strict=True))})
                for combo in itertools.islice(combinations, _MAX_COMBINATIONS)
            ):
                continue
            raise ConfigError(
                f"tune.space.{k.name}: the value {value!r} in its range is one the engine "
                f"refuses ({refusal}); narrow the range"
            )


_MAX_COMBINATIONS = 4096  # of the other knobs' bounds and choices tried for a refused value


def _candidates(knob: Knob) -> list[Any]:
    if knob.values is not None:
        return list(knob.values.values())
    if knob.type == "categorical":
        return list(knob.choices)
    return [int(knob.low), int(knob.high)] if knob.type == "int" else [knob.low, knob.high]


def _accepted(engine: EngineConfig, values: dict[str, Any]) -> bool:
    try:
        engine.with_overrides(**values)
    except ConfigError:
        return False
    return True


def suggest(trial: optuna.Trial, knobs: list[Knob]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for k in knobs:
        if k.type == "categorical":
            params[k.name] = trial.suggest_categorical(k.name, list(k.choices))
        elif k.type == "int":
            step = int(k.step) if k.step else 1
            params[k.name] = trial.suggest_int(
                k.name, int(k.low), int(k.high), step=step, log=k.log
            )
        else:
            params[k.name] = trial.suggest_float(k.name, k.low, k.high, step=k.step, log=k.log)
    return params


def engine_values(knobs: list[Knob], params: Mapping[str, Any]) -> dict[str, Any]:
    """Trial parameters as engine values (named values replaced by what they name)."""
    named = {k.name: k.values for k in knobs if k.values is not None}
    return {name: named[name][value] if name in named else value for name, value in params.items()}


def overrides(values: Mapping[str, Any]) -> list[str]:
    """Hydra override strings (``engine.<knob>=<value>``), strings quoted so ``off`` stays text.

    Only plain values: Hydra merges a dict override into the existing dict (it cannot
    replace ``codecs``), so containers are set on the composed config instead (see
    :func:`split_containers`).
    """
    return [f"engine.{name}={_literal(value)}" for name, value in values.items()]


def split_containers(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(plain values, dict/list values)`` of a trial's engine values."""
    plain = {k: v for k, v in values.items() if not isinstance(v, Mapping | list | tuple)}
    return plain, {k: v for k, v in values.items() if k not in plain}


def _literal(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"cannot express {value} as a config value")
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    raise ConfigError(f"{value!r} is not a plain value; name it under `values` in tune.space")


def base_params(engine: EngineConfig, knobs: list[Knob]) -> dict[str, Any]:
    """The base engine's values for the knobs whose range contains them (trial 0)."""
    values = engine.to_dict()
    params = {}
    for k in knobs:
        value = values[k.name]
        if not k.contains(value):
            continue
        if k.values is not None:
            value = next(name for name, v in k.values.items() if v == value)
        params[k.name] = value
    return params


def fixed_knobs(task_overrides: list[str]) -> set[str]:
    """Engine knobs pinned on the command line: ``engine.checksum=none``, or ``kernels=numba``
    (that group sets ``engine.copy_backend``)."""
    fixed = set()
    for override in task_overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("engine."):
            fixed.add(key.removeprefix("engine."))
        elif key == "kernels":
            fixed.add("copy_backend")
    return fixed
