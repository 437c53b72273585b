"""Ranges of the apps' numeric knobs, checked right after composing, before anything runs.

The dataclass schemas (:mod:`pcframe.apps.schemas`) make OmegaConf check each value's
*type*; they cannot say that ``steps=-5`` or ``workload.args.hidden=0`` makes no sense, and
such a run used to go ahead (training nothing, or a model without units). Every count,
size, interval and duration whose invalid values are obvious is listed here with its range;
:func:`check_bounds` refuses the first value outside it with a :class:`ConfigError` naming
the key and the range (one line, exit code 2 through :mod:`pcframe.apps.errors`).

The engine's keys are not here: :class:`pcframe.config.EngineConfig` checks its own. A
policy's arguments are checked by its constructor (see :func:`pcframe.apps.instantiate.build`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf

from pcframe.errors import ConfigError
from pcframe.format.manifest import MAX_STEP
from pcframe.runtime.checks import real_number


@dataclass(frozen=True)
class Range:
    """``low <= value`` (``low < value`` when ``above``), up to ``high``; ``None`` allowed
    when ``null``. ``what`` says what the value means, ``whole`` that it counts something
    (for the message: the schema already refuses a fraction there), ``finite`` that
    infinity is no value of it either (a time that never comes drops its kill)."""

    low: float
    what: str
    above: bool = False
    high: float | None = None
    null: bool = False
    whole: bool = False
    finite: bool = False
    # ``high`` is a limit of the format, not of sense (MAX_STEP): named only to a value above
    # it, so that steps=0 still reads "a whole number >= 1"
    limit: bool = False

    def accepts(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.finite and isinstance(value, float) and math.isinf(value):
            return False
        if value < self.low or (self.above and value == self.low):
            return False
        return self.high is None or value <= self.high

    def text(self, items: bool = False, value: float | None = None) -> str:
        """What to give; ``value``: the one refused (a ``limit`` is named only above it)."""
        kind = "whole number" if self.whole else "finite number" if self.finite else "number"
        kind = f"a list of {kind}s" if items else f"a {kind}"
        low = f"> {_bound_text(self.low)}" if self.above else f">= {_bound_text(self.low)}"
        high = self.high
        named = high is not None and (not self.limit or (value is not None and value > high))
        span = f"{_bound_text(self.low)}..{_bound_text(high)}" if named else low
        return f"{kind} {span}" + (" or null" if self.null else "")


def _bound_text(value: float) -> str:
    """A bound as written: whole numbers in full (:data:`MAX_STEP` is not 4.61169e+18)."""
    return f"{value:,}" if isinstance(value, int) and abs(value) >= 10**6 else f"{value:g}"


def _count(what: str, low: int = 1, null: bool = False) -> Range:
    return Range(low, what, null=null, whole=True)


def _steps(what: str, low: int = 1) -> Range:
    """A number of training steps: a checkpoint records its step, and a reader refuses one
    beyond :data:`MAX_STEP` (``steps=99999999999999999999999`` was accepted and trained
    towards a step no checkpoint could hold)."""
    return Range(low, what, high=MAX_STEP, whole=True, limit=True)


def _positive(what: str, null: bool = False) -> Range:
    return Range(0, what, above=True, null=null)


# A failure group's keys exist only in the modes that have them (none has no max_kills).
FAILURE = {
    "failure.restart_delay": Range(0, "seconds"),
    "failure.max_kills": _count("kills at most (0: none)", 0),
    "failure.timeout": _positive("seconds the whole supervised run may take"),
    "failure.target_kills": _positive("kills a derived schedule aims at"),
    "failure.mtbf": _positive("mean seconds between kills", null=True),
    "failure.compression": _positive("trace seconds per wall second", null=True),
    "failure.offset": Range(0, "trace seconds skipped at the start", finite=True),
    # A list: each item is checked (NaN was dropped without a word, so fewer kills came).
    "failure.times": Range(0, "kill times in trace seconds", null=True, finite=True),
}

TUNE = {
    "tune.n_trials": _count("trials"),
    "tune.timeout": _positive("seconds the study may take", null=True),
    "tune.interval": _steps("steps between checkpoints"),
    "tune.steps": _steps("steps per measured segment"),
    "tune.repeats": _count("segment pairs per trial"),
    "tune.warmup_steps": _steps("warm-up steps", 0),
    "tune.memory_budget": _count("bytes of staging memory", null=True),
    "tune.pruner_startup_trials": _count("trials before pruning", 0),
    "tune.confirm": _count("best trials measured again (0: none)", 0),
    "tune.heartbeat": _count("seconds between heartbeats (0 or null: none)", 0, null=True),
}

_SHARED_ARGS = {
    "samples": _count("training samples"),
    "batch_size": _count("samples per batch"),
    "layers": _count("hidden layers (0: none)", 0),
    "lr": _positive("the learning rate"),
    "dropout": Range(0, "the dropout probability", high=1),
}

# workload name -> its factory's arguments (pcframe.apps.workloads); ``seed`` takes any value.
WORKLOAD_ARGS = {
    "mlp": {
        **_SHARED_ARGS,
        "hidden": _count("units per hidden layer"),
        "inputs": _count("input features"),
        "classes": _count("classes"),
    },
    "gpt": {
        **_SHARED_ARGS,
        "vocab": _count("tokens in the vocabulary"),
        "context": _count("tokens per sample"),
        "width": _count("the model width"),
        "heads": _count("attention heads"),
        "branching": _count("likely successors per token"),
    },
}

APP_KEYS = {
    "run": {
        "steps": _steps("training steps"),
        "baseline_runs": _count("runs without checkpointing; 3 or more give the overhead a ±"),
        **FAILURE,
    },
    "tune": TUNE,
}

_ABSENT = object()


def check_bounds(cfg: DictConfig, app: str) -> None:
    """Raise :class:`ConfigError` for the first knob of ``app`` (``run``, ``tune``) that is
    out of its range; keys the config does not have are skipped."""
    for key, bound in APP_KEYS.get(app, {}).items():
        _check(cfg, key, bound)
    name = OmegaConf.select(cfg, "workload.name", default=None)
    for arg, bound in WORKLOAD_ARGS.get(str(name), {}).items():
        _check(cfg, f"workload.args.{arg}", bound)
    if name == "gpt":  # the attention heads split the width evenly
        width = OmegaConf.select(cfg, "workload.args.width")
        heads = OmegaConf.select(cfg, "workload.args.heads")
        if isinstance(width, int) and isinstance(heads, int) and width % heads:
            raise ConfigError(
                f"workload.args.width={width} is invalid: use a multiple of "
                f"workload.args.heads={heads}, e.g. workload.args.width={heads * 64}"
            )


def _check(cfg: DictConfig, key: str, bound: Range) -> None:
    value = OmegaConf.select(cfg, key, default=_ABSENT)
    if value is _ABSENT or (value is None and bound.null):
        return
    if isinstance(value, ListConfig):  # each number in it is checked
        items = list(value)
        if not all(bound.accepts(item) for item in items if real_number(item)):
            raise ConfigError(
                f"{key}={items!r} is out of range: give {bound.text(items=True)} ({bound.what})"
            )
        return
    # Types are the schema's job (a string here is a value like threads=auto, or a
    # key left untyped on purpose): only numbers are range-checked.
    if not real_number(value) and value is not None:
        return
    if value is None or not bound.accepts(value):
        raise ConfigError(
            f"{key}={value!r} is out of range: give {bound.text(value=value)} ({bound.what})"
        )
