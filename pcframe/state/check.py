"""Check: a decoded state tree against the live objects, before any of them is touched.

:func:`plan_load` compares every section of a version with the object it would be loaded
into and returns a :class:`LoadPlan`: what to load and every mismatch, one line each.
:func:`~pcframe.state.apply.apply_tree` refuses a plan with mismatches (strict) or loads
only what fits (``strict=False``). What is compared:

* model: keys both ways, and per tensor the shape and (unless ``allow_cast``) the dtype;
* optimizer (:mod:`pcframe.state.optimizer`): class, param groups, hyperparameters
  and per-parameter state keys, shapes and dtypes;
* scheduler: present, and not of another class (its public keys);
* scaler, extra: present when an object is given (a GradScaler's state complete);
* stateful objects: every name given is saved;
* RNG: every generator state loads into a scratch generator (:func:`pcframe.state.rng.check_rng`).

The policy's learned state is not compared (any policy may read another's state); a failing
``load_state_dict`` of it, or of anything else, is rolled back by the apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pcframe.errors import StateMismatch
from pcframe.state.migrations import as_loaded, has_load_pre_hooks, module_metadata, with_versions
from pcframe.state.objects import Section, TrainingObjects, class_name
from pcframe.state.optimizer import align_to_names, check_optimizer
from pcframe.state.rng import check_rng

__all__ = ["LoadPlan", "LoadRules", "StateMismatch", "class_name", "plan_load", "tensor_misfit"]

RESTORE_HINT = (
    "Pass the same objects that were checkpointed, or restore(strict=False) to load only what fits"
)


@dataclass(frozen=True)
class LoadRules:
    """How a restore treats a version that does not fit the objects exactly.

    Attributes:
        strict: refuse any mismatch (the default). ``False``: load what fits (the model's
            matching keys, every other object whose state fits) and list the rest.
        allow_cast: load tensors saved in another dtype, cast to the live one (otherwise a
            dtype difference is a mismatch).
        partial: the tree holds only the sections this caller loads (a multi-rank restore,
            whose caller checked what it needs: a rank beyond the saved world size keeps its
            own per-rank state); a section missing from it is left alone, not refused.
        owner: the front door the objects were given to, named in the errors (``None``:
            not named).
        hint: the advice that ends a mismatch message (``None``: none).
    """

    strict: bool = True
    allow_cast: bool = False
    partial: bool = False
    owner: str | None = "the Checkpointer"
    hint: str | None = RESTORE_HINT


STRICT = LoadRules()  # a Checkpointer's restore() as called with no arguments


@dataclass
class LoadPlan:
    """What to load into each object (a section absent: leave that object alone)."""

    problems: list[str] = field(default_factory=list)
    states: dict[str, Any] = field(default_factory=dict)  # section -> state to load
    stateful: dict[str, Any] = field(default_factory=dict)  # name -> state to load
    rng_skip: set[str] = field(default_factory=set)  # generators whose saved state is refused
    casts: bool = False  # a dtype mismatch was among the problems
    model_complete: bool = False  # the model's state covers every key of the model
    model_migrated: bool = False  # its values went through the load pre-hooks already


def plan_load(objects: TrainingObjects, tree: Any, rules: LoadRules = STRICT) -> LoadPlan:
    """Compare ``tree`` (a decoded version) with ``objects`` under ``rules``; nothing is
    changed (``rules.strict`` is the apply's to act on)."""
    partial, allow_cast, owner = rules.partial, rules.allow_cast, rules.owner
    plan = LoadPlan()
    if not isinstance(tree, dict):
        plan.problems.append(f"the state tree is a {type(tree).__name__}, not a dict")
        return plan
    given = f"{owner} was given one" if owner else "one was given"

    def wanted(section: str, obj: Any) -> bool:
        if obj is None:
            return False
        if section in tree:
            return True
        if not partial:
            plan.problems.append(f"{section}: the checkpoint holds no {section} state, but {given}")
        return False

    if objects.stateful and wanted(Section.STATEFUL, objects.stateful):
        _check_stateful(objects.stateful, tree[Section.STATEFUL], plan)
    if wanted(Section.SCHEDULER, objects.scheduler):
        _check_scheduler(
            objects.scheduler, tree[Section.SCHEDULER], tree.get("scheduler_class"), plan
        )
    if wanted(Section.SCALER, objects.scaler):
        _check_scaler(objects.scaler, tree[Section.SCALER], plan)
    if objects.policy is not None and Section.POLICY in tree:
        plan.states[Section.POLICY] = tree[Section.POLICY]
    if wanted(Section.OPTIMIZER, objects.optimizer):
        saved_class = tree.get("optimizer_class")
        before = len(plan.problems)
        state, order_problems = tree[Section.OPTIMIZER], []
        if objects.model is not None:
            state, order_problems = align_to_names(
                state, tree.get("optimizer_param_names"), objects.model, objects.optimizer
            )
        state = check_optimizer(
            objects.optimizer,
            state,
            saved_class if isinstance(saved_class, str) else None,
            allow_cast,
            plan.problems,
        )
        plan.casts |= any("dtype" in p for p in plan.problems[before:])
        if len(plan.problems) == before:
            plan.problems += order_problems
        if len(plan.problems) == before:
            plan.states[Section.OPTIMIZER] = state
    if wanted(Section.MODEL, objects.model):
        _check_model(
            objects.model, tree[Section.MODEL], tree.get("model_versions"), allow_cast, plan
        )
    if Section.RNG in tree:
        refused = check_rng(tree[Section.RNG])
        plan.problems += [f"rng[{name!r}]: {why}" for name, why in refused.items()]
        if Section.RNG not in refused:  # a dict of generator states: restore the valid ones
            plan.states[Section.RNG] = tree[Section.RNG]
            plan.rng_skip = set(refused)
    if isinstance(objects.extra, dict) and wanted(Section.EXTRA, objects.extra):
        if isinstance(tree[Section.EXTRA], dict):
            plan.states[Section.EXTRA] = tree[Section.EXTRA]
        else:
            plan.problems.append(f"extra: the checkpoint holds a {type(tree['extra']).__name__}")
    return plan


def describe_problems(where: str, given: str, problems: list[str], hint: str | None) -> str:
    """One message listing every problem (the text of a :class:`StateMismatch`)."""
    count = f"{len(problems)} mismatch{'es' if len(problems) != 1 else ''}"
    lines = "".join(f"\n  - {problem}" for problem in problems)
    tail = f"\n{hint}" if hint else ""
    return f"{where} does not fit {given} ({count}; nothing was loaded):{lines}{tail}"


def _check_model(
    model: torch.nn.Module, saved: Any, versions: Any, allow_cast: bool, plan: LoadPlan
) -> None:
    if not isinstance(saved, dict):
        plan.problems.append(
            f"model: the checkpoint holds a {type(saved).__name__}, not a state dict"
        )
        return
    live = model.state_dict()
    module = isinstance(model, torch.nn.Module)  # or any object with both methods
    metadata = module_metadata(model, versions) if module else None
    compared, unexpected = saved, [key for key in saved if key not in live]
    if module and has_load_pre_hooks(model):  # keys as the model's own migrations leave them
        try:
            seen = as_loaded(model, saved, metadata)
        except Exception as exc:  # the user's hook, on data it may not expect
            plan.problems.append(
                f"model: a load_state_dict pre-hook raised on this checkpoint "
                f"({type(exc).__name__}: {exc})"
            )
            return
        compared, unexpected = seen.state, seen.unexpected
    missing = [key for key in live if key not in compared]
    fits: dict[str, Any] = {}
    for key, value in live.items():
        if key not in compared:
            continue
        problem = tensor_misfit(value, compared[key], allow_cast)
        if problem:
            plan.casts |= "dtype" in problem
            plan.problems.append(f"model[{key!r}]: {problem}")
        else:
            fits[key] = compared[key]
    if missing:
        plan.problems.append(
            f"model: keys the checkpoint lacks: {missing}{_prefix_hint(missing, unexpected)}"
        )
    if unexpected:
        plan.problems.append(f"model: keys the model lacks: {unexpected}")
    if fits:
        plan.model_complete = len(fits) == len(live)
        if compared is not saved and plan.model_complete and not unexpected:
            fits = saved  # the hooks migrate it inside load_state_dict, as torch's load does
        else:  # what fits is already migrated: loaded with the hooks held off
            plan.model_migrated = compared is not saved
        plan.states[Section.MODEL] = with_versions(fits, metadata)


def tensor_misfit(live: Any, saved: Any, allow_cast: bool) -> str | None:
    """Why ``saved`` cannot be loaded into the live tensor ``live`` (``None``: it can)."""
    if not isinstance(live, torch.Tensor):
        return None  # extra state: the module's own set_extra_state judges it
    if not isinstance(saved, torch.Tensor):
        return f"the checkpoint holds a {type(saved).__name__}, not a tensor"
    if live.is_meta:  # load_state_dict into it is a no-op that only warns
        return (
            "the tensor here is on the meta device (it has no memory to load into); "
            "materialise the model first (model.to_empty(device=...)), then restore"
        )
    if tuple(saved.shape) != tuple(live.shape):
        return f"shape {tuple(saved.shape)} in the checkpoint, {tuple(live.shape)} here"
    if saved.dtype != live.dtype and not allow_cast:
        return f"dtype {saved.dtype} in the checkpoint, {live.dtype} here"
    shared = [
        dim
        for dim, (n, step) in enumerate(zip(live.shape, live.stride(), strict=True))
        if n > 1 and not step
    ]
    if shared:  # torch.ones(1).expand(4): copying into it fails half-way through an apply
        return (
            f"the tensor here is a broadcast view (stride 0 in dim {shared[0]}: its elements "
            "share one memory location), which nothing can be loaded into (load_state_dict "
            "fails on it too); register a real tensor instead (.expand(...).clone())"
        )
    return None


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """A hint when the two key lists differ only by a wrapper's prefix (DDP's 'module.')."""
    if not missing or len(missing) != len(unexpected):
        return ""
    pairs = (
        (sorted(unexpected), sorted(missing), "checkpoint"),
        (sorted(missing), sorted(unexpected), Section.MODEL),
    )
    for longer, shorter, side in pairs:
        if len(longer[0]) > len(shorter[0]) and longer[0].endswith(shorter[0]):
            prefix = longer[0][: len(longer[0]) - len(shorter[0])]
            if [prefix + key for key in shorter] == longer:
                return f" (the {side}'s keys carry an extra prefix {prefix!r}: the same wrapping?)"
    return ""


def _check_scheduler(scheduler: Any, saved: Any, saved_class: Any, plan: LoadPlan) -> None:
    """A scheduler of another class is refused: torch's ``LRScheduler.load_state_dict`` is a
    ``__dict__.update``, so a StepLR's state loads into an ExponentialLR and makes a hybrid
    of both schedules. Versions name the class (``scheduler_class``); for older ones the
    public keys tell: another class has keys this one lacks *and* lacks some of its own (one
    direction alone may be a torch release adding a field)."""
    if isinstance(saved_class, str) and saved_class != class_name(scheduler):
        plan.problems.append(
            f"scheduler: the checkpoint's scheduler is a {saved_class}, this one a "
            f"{class_name(scheduler)}: build the scheduler the run was saved with"
        )
        return
    live = scheduler.state_dict() if callable(getattr(scheduler, "state_dict", None)) else None
    if isinstance(live, dict) and isinstance(saved, dict):
        public = {key for key in live if isinstance(key, str) and not key.startswith("_")}
        kept = {key for key in saved if isinstance(key, str) and not key.startswith("_")}
        if kept - public and public - kept:
            plan.problems.append(
                f"scheduler: the checkpoint's scheduler state has {sorted(kept - public)}, "
                f"which this {type(scheduler).__name__} lacks, and lacks its "
                f"{sorted(public - kept)}: it was saved by another scheduler class"
            )
            return
    plan.states[Section.SCHEDULER] = saved


def _check_stateful(given: Any, saved: Any, plan: LoadPlan) -> None:
    if not isinstance(saved, dict):
        plan.problems.append(f"stateful: the checkpoint holds a {type(saved).__name__}, not a dict")
        return
    for name in given:
        if name in saved:
            plan.stateful[name] = saved[name]
        else:
            plan.problems.append(
                f"stateful[{name!r}]: the checkpoint has no stateful object named {name!r} "
                f"(it has {sorted(saved)})"
            )


def _check_scaler(scaler: Any, saved: Any, plan: LoadPlan) -> None:
    live = scaler.state_dict()
    if isinstance(live, dict) and live:  # an enabled GradScaler reads every key it saves
        lacking = sorted(set(live) - set(saved)) if isinstance(saved, dict) else sorted(live)
        if lacking:
            plan.problems.append(
                f"scaler: the checkpoint's scaler state lacks {lacking} (saved from a disabled "
                "scaler, or another kind of object?)"
            )
            return
    plan.states[Section.SCALER] = saved
