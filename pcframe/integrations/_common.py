"""What the framework integrations share: the import guard, the policy argument, ``resume=``,
the all-or-nothing apply of the framework's own state, the data shape a position refers to,
and how a failed version is reported."""

from __future__ import annotations

import contextlib
import copy
import difflib
import importlib
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

from pcframe.checkpointer import Checkpointer
from pcframe.config import EngineConfig
from pcframe.decisions import checked_notices
from pcframe.distributed.options import check_job_options
from pcframe.errors import (
    INTACT,
    NONE_COMMITTED,
    CheckpointError,
    ConfigError,
    PolicyError,
    SaveError,
    StateMismatch,
)
from pcframe.policies.base import IntervalPolicy
from pcframe.policies.fixed import FixedSteps
from pcframe.policies.placement.base import PlacementPolicy
from pcframe.policies.registry import create
from pcframe.store.tiers import Tiers

log = logging.getLogger("pcframe")

DEFAULT_EVERY = 100  # steps between versions when neither a policy nor an interval is given


def require_library(module: str, integration: str, extra: str) -> ModuleType:
    """Import ``module`` or raise the one-line error that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"pcframe.integrations.{integration} needs {extra}: pip install 'pcframe[{extra}]'"
        ) from exc


def resolve_policy(
    policy: IntervalPolicy | str | None,
    every: int | None,
    every_name: str,
    options: dict[str, Any] | None = None,
) -> IntervalPolicy:
    """The interval policy from ``policy=`` (an object or a registered name) or ``every``.

    ``every`` is the framework's own spelling of a fixed interval (``every_n_train_steps``,
    ``save_steps``); giving both it and a policy is ambiguous and refused.
    """
    if policy is not None and every is not None:
        raise ValueError(
            f"give either policy= or {every_name}= (it means policy=FixedSteps({every})), not both"
        )
    if options and not isinstance(policy, str):
        raise ValueError("policy_options= goes with a policy name, e.g. policy='young'")
    if isinstance(policy, str):
        try:
            made = create(policy, **(options or {}))
        except KeyError as exc:
            raise ValueError(str(exc.args[0])) from None
        except TypeError as exc:
            raise ValueError(f"policy {policy!r}: {exc} (check policy_options=)") from None
        policy = made
    if policy is None:
        return FixedSteps(every if every is not None else DEFAULT_EVERY)
    if not isinstance(policy, IntervalPolicy):
        raise TypeError(
            f"policy= must be a pcframe.policies interval policy or its name, not "
            f"{type(policy).__name__} (e.g. pcframe.policies.FixedSteps(50) or 'young')"
        )
    return policy


def check_resume(resume: Any) -> bool | int:
    """``"auto"`` (newest valid version) -> True, ``False`` (never), or a version number."""
    if resume == "auto" or resume is True:
        return True
    if resume is False or resume is None:
        return False
    if isinstance(resume, int) and resume >= 1:  # versions count from 1
        return resume
    raise ValueError(
        f"resume={resume!r}: use 'auto' (the newest valid version), False, or a version "
        "number (1 or more)"
    )


# --- the framework's own state, applied inside the engine's all-or-nothing restore -------------

ROLLBACK_MARK = "pcframe-integration-rollback"  # the section's "state" while a restore runs


class Undo:
    """Undo steps of one restore, run newest first."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], object]] = []

    def push(self, step: Callable[[], object]) -> None:
        self.steps.append(step)

    def run(self) -> None:
        steps, self.steps = self.steps, []
        failed: Exception | None = None
        for step in reversed(steps):
            try:
                step()
            except Exception as exc:  # undo what can be undone; raise the first failure after
                log.error("rolling back a refused resume: %s", exc)
                failed = failed or exc
        if failed is not None:
            raise CheckpointError(
                f"a resume was refused and rolling it back failed too ({failed}): the trainer "
                "may be partly loaded; build it again before training"
            ) from failed

    def load(self, obj: Any, state: Any) -> None:
        """``obj.load_state_dict(state)``, undone by loading back a copy of its state before."""
        before = copy.deepcopy(obj.state_dict())
        try:
            obj.load_state_dict(copy.deepcopy(state))  # as Lightning: the object may keep it
        except BaseException:
            # It refused, maybe half-way: put back what it had. An object that checks before
            # it changes anything may refuse that too; then it holds what it had anyway.
            with contextlib.suppress(Exception):
                obj.load_state_dict(before)
            raise
        self.push(lambda: obj.load_state_dict(before))


class RestoredSection:
    """A ``stateful=`` section of the framework's own state (loops, callbacks, data position)
    applied *inside* :meth:`Checkpointer.restore`, so that a refusal of any part of it, or of
    the model or optimizer after it, changes nothing at all.

    The engine loads the ``stateful`` objects first, each after keeping ``state_dict()`` as
    its undo, and on any later failure loads that back (``pcframe.state.apply``). While a
    restore runs (:meth:`restoring`), ``state_dict()`` is a mark and loading the mark undoes
    what :meth:`apply` changed, so the engine's rollback covers this section's changes too.
    Outside a restore, ``state_dict()`` is :meth:`capture` (what every version saves).
    """

    def __init__(self) -> None:
        self._undo: Undo | None = None

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        self._undo = Undo()
        try:
            yield
        finally:  # applied: the changes stay; refused: they were undone by then
            self._undo = None

    def capture(self) -> dict[str, Any]:
        raise NotImplementedError

    def apply(self, state: dict[str, Any], undo: Undo) -> None:
        """Apply ``state``; every change first pushes its undo. Raise to refuse the version."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        if self._undo is not None:
            return {ROLLBACK_MARK: True}
        return self.capture()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        undo = self._undo
        if undo is None:
            raise RuntimeError(f"{type(self).__name__} is loaded by the callback's restore only")
        if not isinstance(state, dict):
            raise ValueError(f"the saved section is a {type(state).__name__}, not a dict")
        if len(state) == 1 and state.get(ROLLBACK_MARK) is True:  # the engine rolls back
            undo.run()
            return
        try:
            self.apply(state, undo)
        except BaseException:
            undo.run()
            raise


# --- the data a mid-epoch position refers to ---------------------------------------------------


def data_shape(loader: Any) -> dict[str, int | None]:
    """How many samples and batches one epoch of ``loader`` has (``None``: it has no length).

    A mid-epoch position (``k`` batches of this epoch trained) means the same samples only in
    data of the same shape: in a shorter dataset the order is another permutation and the
    position skips samples that were never trained.
    """
    dataset = getattr(loader, "dataset", None)
    if dataset is None:  # a wrapper such as pcframe's ResumableLoader
        dataset = getattr(getattr(loader, "loader", None), "dataset", None)
    return {"samples": length(dataset), "batches": length(loader)}


def length(obj: Any) -> int | None:
    if obj is None:
        return None
    try:
        return len(obj)
    except (TypeError, NotImplementedError):  # an IterableDataset, a generator
        return None


def shape_changes(saved: Any, now: dict[str, Any]) -> list[str]:
    """``"samples 40 -> 30"`` for each recorded quantity that differs (both known)."""
    if not isinstance(saved, dict):
        return []
    return [
        f"{name} {saved[name]} -> {now[name]}"
        for name in now
        if saved.get(name) is not None and now[name] is not None and saved[name] != now[name]
    ]


# --- a failed version while the callback runs --------------------------------------------------


class CallbackSaveError(SaveError):
    """A :class:`SaveError` as the callback reports it: what the callback did about it.

    The engine's message ends "training may continue" (true of a loop that catches it); the
    callbacks stop the fit instead, or find the failure once training has ended, and say so.
    ``version``, ``step``, ``stage``, ``cause`` and ``committed_before`` are the engine's
    error's.
    """

    def __init__(
        self,
        message: str,
        version: int,
        step: int,
        stage: str,
        cause: BaseException,
        committed_before: bool = True,
    ):
        CheckpointError.__init__(self, message)  # pickled as a SaveError is
        self.version, self.step, self.stage, self.cause = version, step, stage, cause
        self.committed_before = committed_before

    def __str__(self) -> str:
        return str(self.args[0])


def stopped_by(error: SaveError, owner: str, step: int, finished: bool, again: str) -> SaveError:
    """``error`` reworded for a callback: it stopped training at ``step``, or (``finished``)
    training had ended at ``step`` when the failure was found; ``again`` resumes."""
    what = str(error).removesuffix(INTACT).removesuffix(NONE_COMMITTED).rstrip()
    if not error.committed_before and finished:  # the first save: nothing to resume from
        told = (
            f"{owner}: training ended at step {step}, but {what} No version was committed in "
            f"this directory: fix the cause and save again, or {again} to train from the start"
        )
    elif not error.committed_before:
        told = (
            f"{owner} stopped training at step {step}: {what} No version was committed in this "
            f"directory yet: fix the cause and {again} (it starts from the beginning)"
        )
    elif finished:
        told = (
            f"{owner}: training ended at step {step}, but {what} The last committed checkpoint "
            f"is intact but older than the end of training: fix the cause and save again, or "
            f"{again} to resume from it"
        )
    else:
        told = (
            f"{owner} stopped training at step {step}: {what} The last committed checkpoint is "
            f"intact: fix the cause and {again} to resume from it"
        )
    return CallbackSaveError(
        told, error.version, error.step, error.stage, error.cause, error.committed_before
    )


def policy_stopped(
    error: PolicyError, owner: str, step: int, finished: bool, again: str
) -> PolicyError:
    """``error`` (the interval or placement policy broke its contract: the engine's line
    names it) reworded as :func:`stopped_by` words a failed version: the callback stopped
    training at ``step``, or (``finished``) training had ended there when it was found.
    Before, it left the callback as the engine raised it, from deep inside the engine. The
    engine's error is the new one's ``__cause__`` (``raise ... from error``)."""
    what = " ".join(str(error).split())
    what = what if what.endswith(".") else f"{what}."
    said = (
        f"{owner}: training ended at step {step}, but {what}"
        if finished
        else f"{owner} stopped training at step {step}: {what}"
    )
    return PolicyError(
        f"{said} No committed version was lost: fix the policy and {again} to resume from "
        "the newest one"
    )


def close_quietly(checkpointer: Checkpointer, owner: str) -> None:
    """Close after an exception: never raise over it (the lock is released either way)."""
    try:
        checkpointer.close(clean=False)
    except Exception as exc:  # a failed version found while closing: the original error wins
        log.error("%s: closing the Checkpointer after an error: %s", owner, exc)


# --- options checked when the callback is made (not when training starts) ----------------------

# What a Checkpointer takes besides EngineConfig's fields, and what only the multi-process
# engine (DistributedCheckpointer) takes: accepted by a callback, ignored in one process.
ENGINE_ARGUMENTS = ("config", "tiers", "placement", "notices")
DISTRIBUTED_ARGUMENTS = (
    "keep_global",
    "protocol_timeout",
    "replicas",
    "peer_dir",
    "peer_budget",
    "node",
)


def check_flag(owner: str, name: str, value: Any) -> bool:
    """``value`` if it is a bool (``save_last="false"`` was truthy, and
    ``trainer_checkpoints="no"`` kept the Trainer's checkpoints).

    Raises:
        ConfigError: naming the option and the fix.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}: {name}={value!r}: use True or False")
    return value


def check_engine_options(
    owner: str, options: dict[str, Any], own: list[str], refused: dict[str, str]
) -> None:
    """Refuse, in one line, an option of ``options`` (the callback's ``**engine_options``)
    that no engine takes, or whose value the engine would refuse, when the callback is made.

    ``own``: the callback's own argument names (offered as near matches); ``refused``: the
    framework's own options the callback deliberately does not take, with the reason.
    """
    fields = set(EngineConfig().to_dict())
    known = fields | set(ENGINE_ARGUMENTS) | set(DISTRIBUTED_ARGUMENTS)
    for name in options:
        if name in refused:
            raise ValueError(f"{owner}: {name}= {refused[name]}")
        if name not in known:
            near = difflib.get_close_matches(name, [*own, *sorted(known)], n=1)
            hint = f" (did you mean {near[0]}=?)" if near else ""
            raise TypeError(
                f"{owner}: unknown option {name}={options[name]!r}{hint}; it takes its own "
                f"arguments ({', '.join(own)}) and pcframe's engine options "
                "(pcframe.config.EngineConfig fields, e.g. keep_last=3, max_in_flight=2)"
            )
    config = options.get("config")
    if config is not None and not isinstance(config, EngineConfig):
        raise TypeError(f"{owner}: config= must be a pcframe.config.EngineConfig")
    # The values too (a ConfigError, one line naming the option), before any fit runs.
    (config or EngineConfig()).with_overrides(**{k: v for k, v in options.items() if k in fields})
    try:  # the options the engine takes as objects, and a multi-rank job's own
        checked_notices(options.get("notices"))
        given = {k: v for k, v in options.items() if k in DISTRIBUTED_ARGUMENTS}
        if given:
            defaults = {"keep_global": 2, "protocol_timeout": 1800.0, "replicas": 1}
            check_job_options(**{**defaults, **given})
    except ConfigError as exc:
        raise ConfigError(f"{owner}: {exc}") from None
    tiers, placement = options.get("tiers"), options.get("placement")
    if tiers is not None and not isinstance(tiers, Mapping | Tiers):  # Tiers: built already
        raise ConfigError(
            f"{owner}: tiers={tiers!r}: give {{name: tier}}, e.g. tiers={{'remote': 's3://bucket/run'}}"
        )
    if placement is not None and not isinstance(placement, PlacementPolicy):
        raise ConfigError(
            f"{owner}: placement={placement!r}: give a placement policy, e.g. "
            "pcframe.policies.LocalPlusRemote()"
        )


# --- a resume the engine refused: one line, with the fix the callback's user can make ---------

# The multi-rank restore's own refusals of the saved state (one line each, "rank 1: " before
# it on the ranks that learned it from another): its keys, its tensors' global shapes, its
# sections. Another rank's StateMismatch reaches the others as "rank 1: <its message>".
_JOB_MISFIT = re.compile(
    r"^(rank \d+: )?(global version \d+ (does not fit|has no|holds no|has optimizer state)"
    r"|'[^']*' has global shape )"
)
_RANK = re.compile(r"^rank \d+: ")
# The engine's advice inside a mismatch line, which a callback's user cannot follow (the
# callback calls restore() itself), and its "pass the same objects" (said better after it).
_ENGINE_ADVICE = re.compile(
    r"[;:]?\s*(restore with strict=False|restore\(strict=|restore\(allow_cast=|pass the same "
    r"|pass objects of the same |build the scheduler the run was saved with"
    r"|build them in the dtypes they were saved in).*$"
)
_DTYPE = re.compile(r"dtype (\S+) in the checkpoint, (?:its parameter's is )?(\S+?)(?: here)?$")
# torch's module path of a class (its name says enough), with the article before it ("a
# torch.optim.adamw.AdamW" reads "AdamW", not "a AdamW").
_TORCH_CLASS = re.compile(r"\b(?:an? )?torch\.optim\.(?:lr_scheduler\.|[a-z_]+\.)(?=[A-Z])")
_SHOWN = 120  # characters of the mismatch a message shows

# What does not fit, in the order a message names it: the first kind found among the
# mismatches is named, with the fix that kind has besides another folder or resume=False.
_KINDS: dict[str, tuple[str, str]] = {
    # no section of the callback's own: another writer's folder (a loop's own Checkpointer)
    "foreign": ("that the callback did not write", ""),
    "model": ("of another model", ""),
    "dtype": ("", ""),  # worded from the dtypes themselves
    "optimizer": (
        "of another optimizer",
        "configure the optimizer the run was saved with (its class and param groups), ",
    ),
    "scheduler": (
        "of another LR scheduler",
        "configure the LR scheduler the run was saved with, ",
    ),
    "other": ("that do not fit this run", ""),
}


def refused_resume(
    owner: str,
    directory: Any,
    error: BaseException,
    folder: str = "dirpath",
    dtype_fix: str = "build the model in {} as it was saved",
) -> StateMismatch | None:
    """A resume the engine refused because the saved state does not fit this run's objects
    (another model, a dtype, an optimizer or a scheduler of another setup), as one line naming
    the folder, what does not fit, and the fix the callback's user can make: the engine's own
    advice (``restore(strict=False)``, ``restore(allow_cast=True)``) is no option of a
    callback, which calls ``restore()`` itself. ``mismatches`` keeps every problem the engine
    found; ``folder``: the callback's name of its directory argument; ``dtype_fix``: how its
    user gets the saved dtype (``{}``) back. ``None``: ``error`` is no such refusal (a damaged
    version, a section's own refusal of the data: its message says more; a section's
    ``StateMismatch`` is one)."""
    mismatches = _mismatches(error)
    if not mismatches:
        return None
    kinds = [_kind(m) for m in mismatches]
    kind = next(k for k in _KINDS if k in kinds)
    chosen = [m for m, k in zip(mismatches, kinds, strict=True) if k == kind]
    if kind == "dtype":  # a model's tensor says more than its optimizer state
        chosen.sort(key=lambda m: not _RANK.sub("", m).startswith("model"))
    first = _shown(chosen[0])
    more = f"; {len(mismatches) - 1} more" if len(mismatches) > 1 else ""
    what, fix = _KINDS[kind]
    if kind == "dtype":
        saved, live = _dtypes(chosen)
        what = f"of a model in {saved}, and this run's is in {live}"
        fix = dtype_fix.format(saved) + ", "
    return StateMismatch(
        f"{owner}: {directory} holds checkpoints {what} ({first}{more}): {fix}give this run "
        f"its own {folder}, or pass resume=False to start over in {directory}",
        mismatches,
    )


def _mismatches(error: BaseException) -> list[str]:
    """The mismatches of a refused restore (one process's, or a multi-rank one's), or none."""
    if type(error) is CheckpointError and isinstance(error.__cause__, StateMismatch):
        # A section's StateMismatch (the Trainer's LR schedule), raised inside the engine's
        # apply, which rolled every object back and chained it.
        return _mismatches(error.__cause__)
    if isinstance(error, StateMismatch):
        return list(error.mismatches) or [" ".join(str(error).split())]
    if type(error) is not CheckpointError or not _JOB_MISFIT.match(str(error)):
        return []
    text = str(error)
    listed = [line[4:] for line in text.splitlines() if line.startswith("  - ")]
    if listed:  # another rank's StateMismatch: its lines, which this rank's own would be
        return listed
    return [" ".join(text.split())]


def _kind(mismatch: str) -> str:
    line = _RANK.sub("", mismatch)
    if line.startswith("stateful") or " has no stateful object named " in line:
        return "foreign"  # the callback gives one stateful object: its own section
    if _DTYPE.search(line) is not None:
        return "dtype"
    if line.startswith(("model:", "model[", "'model/")) or "does not fit this model" in line:
        return "model"
    if " holds no tensor 'model/" in line:
        return "model"
    if line.startswith(("optimizer", "'optimizer/")) or "optimizer" in line.split(":")[0]:
        return "optimizer"
    if line.startswith("scheduler") or "'scheduler'" in line.split(",")[0]:
        return "scheduler"
    return "other"


def _shown(mismatch: str) -> str:
    """One mismatch as a message shows it: one line, without the engine's advice, short."""
    line = _TORCH_CLASS.sub("", _ENGINE_ADVICE.sub("", " ".join(mismatch.split())))
    line = line.replace("but the Checkpointer was given one", "but this run has one")
    return line if len(line) <= _SHOWN else line[: _SHOWN - 3] + "..."


def _dtypes(mismatches: list[str]) -> tuple[str, str]:
    """The saved and the live dtypes the dtype mismatches name ("torch.float32 and ...")."""
    pairs = [m.groups() for m in map(_DTYPE.search, mismatches) if m is not None]
    saved = sorted({a for a, _ in pairs}) or ["another dtype"]
    live = sorted({b for _, b in pairs}) or ["another"]
    return " and ".join(saved), " and ".join(live)
