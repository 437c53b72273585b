"""Apply: a verified state tree loaded into the live training objects, all or nothing.

The one apply of both front doors: :class:`~pcframe.Checkpointer` applies a whole decoded
version, :class:`~pcframe.distributed.DistributedCheckpointer` the tree one rank assembled
from the shards (``partial=True``: only the sections that rank loads).

First :func:`~pcframe.state.check.plan_load` compares everything with the live objects
and nothing is touched: a mismatch raises one :class:`~pcframe.state.check.StateMismatch`
listing every problem (``strict``), or the objects that do not fit are left out and listed
(``strict=False``). Then each object is loaded after its undo is recorded, and a
``load_state_dict`` that fails anyway rolls every object back, so a failed restore changes
nothing:

* optimizer: torch's ``load_state_dict`` builds the new state and swaps it in, so the undo
  keeps the old ``state`` and ``param_groups`` by reference (no copy); an optimizer with its
  own ``load_state_dict`` gets a deep copy of its ``state_dict()`` instead;
* model: the parameters and buffers, copied to host memory just before the model is loaded
  (the model is loaded last of the fallible objects) and copied back in place on failure,
  and a deep copy of the extra state of each module the load sets it on, set back after;
* tensors the reader fills in place (``fill``: :mod:`pcframe.state.in_place`): no copy
  here. The model and optimizer load with those tensors as they are (the same tensors, so
  an undo above restores everything), and the fill, making them hold the verified bytes,
  is the last step that can fail, for the sections that loaded. Tensors read straight in
  already hold the new bytes; their old ones, kept aside by the reader, go back on any
  failure (``unfill``, or the reader's release when the fill never ran:
  :mod:`pcframe.restore.live`). Only a failure of the fill itself (an I/O error
  re-reading verified bytes) cannot be rolled back; the error says so;
* scheduler, scaler, stateful objects, policy: a deep copy of their ``state_dict()``
  (their restored tensors take the kind the live ones have: ``nn.Parameter``,
  ``requires_grad``; the file holds bytes only);
* RNG and extra: their current state (they cannot fail once checked).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Collection
from itertools import chain
from typing import Any, Protocol

import torch
from torch.optim.optimizer import Optimizer

from pcframe.errors import CheckpointError, RestoreIOError, StateMismatch, refused_memory
from pcframe.state.check import STRICT, LoadPlan, LoadRules, describe_problems, plan_load
from pcframe.state.in_place import plain_module_loading, view_of
from pcframe.state.migrations import load_pre_hooks_held
from pcframe.state.objects import IN_PLACE, Section, TrainingObjects
from pcframe.state.rng import capture_rng, restore_rng

log = logging.getLogger("pcframe")


class InPlaceFill(Protocol):
    """The reader's side of a version read into the live tensors themselves."""

    def fill(self, sections: Collection[str]) -> int:
        """Make the in-place tensors of those tree sections hold the verified bytes (and
        put back the old bytes of the others); their bytes. ``OSError`` if a read fails."""
        ...

    def unfill(self) -> bool:
        """After :meth:`fill`, put the old bytes back; False if it cannot (some were read
        a second time): a rollback then raises."""
        ...


CAST_HINT = "; restore(allow_cast=True) casts tensors to the live dtypes"


def apply_tree(
    objects: TrainingObjects,
    tree: dict[str, Any],
    where: str,
    rules: LoadRules = STRICT,
    fill: InPlaceFill | None = None,
    plan: LoadPlan | None = None,
) -> list[str]:
    """Load ``tree`` (a decoded version) into ``objects`` under ``rules``; ``where`` names
    the version. ``plan``: :func:`~pcframe.state.check.plan_load`'s of the same tree and
    objects, made already (a multi-rank restore checks before the ranks agree).

    ``fill``: the verified bytes of the tensors that ``tree`` holds as the live tensors
    themselves (the reader's in-place targets), read into them for the sections that loaded
    (:meth:`InPlaceFill.fill`), after every other fallible load.

    Returns:
        What was not loaded, one line per mismatch (empty after a strict restore).

    Raises:
        StateMismatch: (a CheckpointError) ``rules.strict`` and the version does not fit the
            objects; the message lists every mismatch. Nothing was changed.
        CheckpointError: a ``load_state_dict`` failed after the checks; every object was
            rolled back to its state before the call, the one that raised included (it may
            be half loaded: its old state goes back through its ``load_state_dict``). The
            message names that object and its error, which is chained; where putting an
            object back fails too, it names the objects that may be partly loaded.
    """
    strict, owner = rules.strict, rules.owner
    given = f"the objects given to {owner}" if owner else "the objects given"
    plan = plan if plan is not None else plan_load(objects, tree, rules)
    if plan.problems and strict:
        advice = rules.hint + (CAST_HINT if plan.casts else "") if rules.hint else None
        raise StateMismatch(describe_problems(where, given, plan.problems, advice), plan.problems)
    not_loaded = list(plan.problems)
    undo = _Undo()
    loaded: set[str] = set()
    loads = _loads(objects, plan, in_place=fill is not None)
    if fill is not None:  # after the model and optimizer, before RNG and extra
        at = next(
            (i for i, (name, _) in enumerate(loads) if name in (Section.RNG, Section.EXTRA)), None
        )
        step = ("in-place tensors", _fill(fill, loaded))
        loads.insert(len(loads) if at is None else at, step)
    for name, load in loads:
        label = _label(objects, name)
        try:
            load(undo)
            loaded.add(name)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            failed = f"loading {label} failed ({error})"
            if not isinstance(exc, Exception):
                stuck = undo.all(label)
                if stuck:
                    log.error("%s", _partly_loaded(where, failed, stuck))
                raise
            if refused_memory(exc):
                # The machine, not the checkpoint: never a mismatch, even with strict=False.
                failed = f"out of memory while loading {label} ({error})"
                stuck = undo.all(label)
                raise RestoreIOError(
                    _partly_loaded(where, failed, stuck)
                    if stuck
                    else f"{where}: {failed}; every object was rolled back, nothing was "
                    "loaded: free memory and restore again"
                ) from exc
            if strict:
                stuck = undo.all(label)
                raise CheckpointError(
                    _partly_loaded(where, failed, stuck)
                    if stuck
                    else f"{where} does not fit {given}: {failed}; every object was rolled "
                    "back, nothing was loaded"
                ) from exc
            stuck = undo.last(label)
            if stuck:  # no object may be left half loaded silently: put every one back
                stuck += undo.all(label)
                raise CheckpointError(_partly_loaded(where, failed, stuck)) from exc
            not_loaded.append(f"{name}: load_state_dict failed: {error}")
        undo.commit_step(label)
    if (
        Section.SCHEDULER in loaded
        and Section.OPTIMIZER not in loaded
        and objects.optimizer is not None
    ):
        _lr_from_scheduler(objects.optimizer, objects.scheduler, not_loaded)
    if not_loaded:
        log.warning("%s: not loaded (strict=False): %s", where, "; ".join(not_loaded))
    return not_loaded


def _lr_from_scheduler(optimizer: Any, scheduler: Any, not_loaded: list[str]) -> None:
    """A refused optimizer beside a restored scheduler: give its groups the schedule's lr.

    The optimizer keeps the lr it was built with, while the scheduler stands where it was
    saved; a chainable schedule (ExponentialLR: lr *= gamma) would go on from the wrong lr.
    """
    last = getattr(scheduler, "get_last_lr", None)
    lrs = last() if callable(last) else None
    groups = optimizer.param_groups
    if not isinstance(lrs, list) or len(lrs) != len(groups):
        return
    for group, lr in zip(groups, lrs, strict=True):
        group["lr"] = lr
    not_loaded.append("optimizer: its lr was set from the restored scheduler")


def _loads(
    objects: TrainingObjects, plan: LoadPlan, in_place: bool
) -> list[tuple[str, Callable[[Any], None]]]:
    """(name, load) for every object the plan loads, in the order they are loaded
    (``in_place``: a fill gives the live tensors among the tree's their bytes afterwards).

    The small objects first; then the optimizer (torch's load is all-or-nothing by itself);
    the model last of the fallible ones (its snapshot is the largest, taken only when it is
    reached); RNG and extra, which cannot fail once checked, at the end.
    """
    states = plan.states
    loads: list[tuple[str, Callable[[Any], None]]] = [
        (f"stateful[{name!r}]", _state_load(objects.stateful[name], state))
        for name, state in plan.stateful.items()
    ]
    for section in (Section.SCHEDULER, Section.SCALER, Section.POLICY):
        if section in states:
            loads.append((section, _state_load(getattr(objects, section), states[section])))
    if Section.OPTIMIZER in states:
        loads.append(
            (Section.OPTIMIZER, _optimizer_load(objects.optimizer, states[Section.OPTIMIZER]))
        )
    if Section.MODEL in states:
        model = _model_load(
            objects.model, states[Section.MODEL], plan.model_complete, in_place, plan.model_migrated
        )
        loads.append((Section.MODEL, model))
    if Section.RNG in states:
        loads.append((Section.RNG, _rng_load(states[Section.RNG], plan.rng_skip)))
    if Section.EXTRA in states:
        loads.append((Section.EXTRA, _extra_load(objects.extra, states[Section.EXTRA])))
    return loads


class _Undo:
    """Undo steps, grouped per object: ``last()`` undoes the object being loaded, ``all()``
    every object. Both run every step they can and return those that failed as (object,
    error) pairs: those objects may be partly loaded."""

    def __init__(self) -> None:
        self.done: list[tuple[str, list[Callable[[], None]]]] = []
        self.current: list[Callable[[], None]] = []

    def push(self, step: Callable[[], None]) -> None:
        self.current.append(step)

    def commit_step(self, label: str) -> None:
        self.done.append((label, self.current))
        self.current = []

    def last(self, label: str) -> list[tuple[str, str]]:
        steps = [(label, step) for step in self.current]
        self.current = []
        return self._run(steps)

    def all(self, label: str) -> list[tuple[str, str]]:
        steps = [(label, step) for step in self.current]
        steps += [(done, step) for done, group in self.done for step in group]
        self.current, self.done = [], []
        return self._run(steps)

    @staticmethod
    def _run(steps: list[tuple[str, Callable[[], None]]]) -> list[tuple[str, str]]:
        stuck = []
        for label, step in reversed(steps):
            try:
                step()
            except Exception as exc:  # undo what can be undone; say what could not
                stuck.append((label, f"{type(exc).__name__}: {exc}"))
                log.error(
                    "rolling back a failed restore: putting back %s failed", label, exc_info=True
                )
        return stuck


def _partly_loaded(where: str, failed: str, stuck: list[tuple[str, str]]) -> str:
    """The message of a failed load whose rollback failed too: the objects whose old state
    could not be put back (``stuck``, from :class:`_Undo`) may be partly loaded."""
    who = " and ".join(dict.fromkeys(label for label, _ in stuck))
    why = "; ".join(f"putting back {label} raised {error}" for label, error in stuck)
    return (
        f"{where}: {failed}, and rolling it back failed too: {who} may be partly loaded "
        f"({why}); every other object was rolled back: restore again or rebuild {who}"
    )


def _label(objects: TrainingObjects, name: str) -> str:
    """How errors name the object ``name`` loads: the policy with its class (a plugin's,
    often), every other by its section or ``stateful[key]``."""
    if name == Section.POLICY:
        return f"policy ({type(objects.policy).__name__})"
    return name


def _deep_copy(state: Any) -> Any:
    """A copy that later loads cannot change (tensors cloned)."""
    return copy.deepcopy(state)


def _state_load(obj: Any, state: Any) -> Callable[[_Undo], None]:
    def load(undo: _Undo) -> None:
        live = obj.state_dict()
        before = _deep_copy(live)
        undo.push(lambda: obj.load_state_dict(before))
        obj.load_state_dict(_typed_like(state, live))

    return load


def _typed_like(state: Any, live: Any) -> Any:
    """``state`` with each tensor given the kind the live object's tensor of that path has:
    an ``nn.Parameter`` where the live one is a Parameter, ``requires_grad`` where the live
    one requires it. The file stores bytes only; without this an object whose
    ``load_state_dict`` keeps what it is given (``self.scale = state["scale"]``) would lose
    its Parameter (and its gradients) on restore, where ``torch.load`` gives one back."""
    if isinstance(state, torch.Tensor) and isinstance(live, torch.Tensor):
        if type(state) is not torch.Tensor or not (state.is_floating_point() or state.is_complex()):
            return state  # integers never require grad; subclasses are left as read
        if type(live) is torch.nn.Parameter:
            return torch.nn.Parameter(state, requires_grad=live.requires_grad)
        return state.requires_grad_() if live.requires_grad else state
    if isinstance(state, dict) and isinstance(live, dict):
        items = {k: _typed_like(v, live[k]) if k in live else v for k, v in state.items()}
        if type(state) is dict:
            return items
        kept = copy.copy(state)  # a Counter, OrderedDict, defaultdict stays one
        dict.update(kept, items)  # (Counter.update would add the counts)
        return kept
    if isinstance(state, list | tuple) and isinstance(live, list | tuple):
        if len(state) != len(live):
            return state
        typed = [_typed_like(v, w) for v, w in zip(state, live, strict=True)]
        if isinstance(state, list):
            return typed
        return tuple.__new__(type(state), typed)  # a namedtuple stays one
    return state


def _optimizer_load(optimizer: Optimizer, state: Any) -> Callable[[_Undo], None]:
    def load(undo: _Undo) -> None:
        if type(optimizer).load_state_dict is Optimizer.load_state_dict:
            # torch builds the new state and param groups, then swaps them in: keep the old.
            kept = {k: optimizer.__dict__[k] for k in ("state", "param_groups")}
            undo.push(lambda: optimizer.__dict__.update(kept))
        else:
            before = _deep_copy(optimizer.state_dict())
            undo.push(lambda: optimizer.load_state_dict(before))
        optimizer.load_state_dict(_indexed(state))

    return load


class _ParamIds(list):
    """A saved param group's ``params`` whose ``in`` is a set lookup. torch's
    ``Optimizer.load_state_dict`` asks, for every state tensor, which group holds its index
    (``param_id in group["params"]``): on plain lists a restore grew with the square of the
    parameters (3200 tensors: 0.12 s of a 0.30 s restore). torch only reads these lists
    (it puts the live groups' own ``params`` in place of them), so the set stays right."""

    def __init__(self, ids: list[Any]) -> None:
        super().__init__(ids)
        self._ids = frozenset(ids)

    def __contains__(self, item: object) -> bool:
        try:
            return item in self._ids
        except TypeError:  # not hashable: as a plain list answers
            return any(item == i for i in self)


def _indexed(state: Any) -> Any:
    """``state`` (an optimizer's state dict) with each group's ``params`` a :class:`_ParamIds`."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        return state
    try:
        indexed = [{**g, "params": _ParamIds(g["params"])} for g in groups]
    except TypeError:  # an unhashable index: torch's own lists then
        return state
    return {**state, "param_groups": indexed}


def _model_load(
    model: torch.nn.Module, state: dict[str, Any], complete: bool, in_place: bool, migrated: bool
) -> Callable[[_Undo], None]:
    """``in_place``: live tensors of the tree get their bytes by ``apply_tree``'s ``fill``.
    ``migrated``: ``state`` went through the load pre-hooks already: they are held off."""

    def load(undo: _Undo) -> None:
        # A tensor the state holds itself (read in place later) keeps its value through
        # load_state_dict: nothing to copy for it. The same view only: another view of its
        # memory (a transposed alias buffer) is loaded from a fresh tensor and writes there.
        held = {view_of(v) for v in state.values() if isinstance(v, torch.Tensor)}
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        for tensor in chain(model.parameters(), model.buffers()):
            if id(tensor) in seen or tensor.is_meta:
                continue
            seen.add(id(tensor))
            local = _local_shard(tensor).detach()
            if local.numel() and view_of(local) in held:
                continue
            saved.append((tensor, local.to("cpu", copy=True)))
        extras = _extra_states(model, state)

        def put_back() -> None:
            with torch.no_grad():
                for tensor, host in saved:
                    _local_shard(tensor).copy_(host)
            for module, extra in extras:  # after its tensors, in the order torch loads them
                module.set_extra_state(_deep_copy(extra))

        undo.push(put_back)
        if not (in_place and _loads_onto_itself(model, state)):
            with load_pre_hooks_held(model) if migrated else contextlib.nullcontext():
                model.load_state_dict(state, strict=complete)

    return load


def _extra_states(model: torch.nn.Module, state: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(module, a copy of its extra state) for every module whose ``set_extra_state`` the
    load of ``state`` calls. torch's ``load_state_dict`` sets them one module at a time, so
    one refusing a value (or the load failing after it) leaves the modules before it holding
    the checkpoint's extra state, which a copy of the parameters and buffers does not undo.
    A module that cannot give its extra state (no ``get_extra_state``: torch's raises) is
    left out: there is nothing to read back."""
    extras: list[tuple[Any, Any]] = []
    if not isinstance(model, torch.nn.Module):  # an object of its own loading: no modules
        return extras
    seen: set[int] = set()
    base = torch.nn.Module
    for name, module in model.named_modules(remove_duplicate=False):
        key = f"{name}._extra_state" if name else "_extra_state"
        kind = type(module)
        if (
            id(module) in seen
            or key not in state
            or kind.set_extra_state is base.set_extra_state
            or kind.get_extra_state is base.get_extra_state
        ):
            continue
        seen.add(id(module))
        extras.append((module, _deep_copy(module.get_extra_state())))
    return extras


def _loads_onto_itself(model: torch.nn.Module, state: dict[str, Any]) -> bool:
    """Whether ``model.load_state_dict(state)`` would only copy each of the model's own
    tensors onto itself: ``state`` has exactly the model's state-dict keys, each value a
    plain CPU tensor with memory of its own (the reader's in-place targets, filled later)
    that is the same view of the same memory as the model's tensor of that name, and the
    model loads the plain torch way (no hooks, extra state or loaders of its own). Then the
    call is skipped: its per-module walk and per-tensor ``copy_`` cost more than the rest of
    the apply (3200 tensors: 50 ms). Never for tensor subclasses: a DTensor's ``data_ptr``
    is 0, so two different DTensors of one shape would look like the same memory."""
    if not plain_module_loading(model):
        return False
    own = model.state_dict(keep_vars=True)
    return own.keys() == state.keys() and all(
        type(value) is torch.Tensor
        and type(own[key]) in (torch.Tensor, torch.nn.Parameter)
        and value.is_cpu
        and value.numel()
        and view_of(value) == view_of(own[key])
        for key, value in state.items()
    )


def _fill(fill: InPlaceFill, loaded: set[str]) -> Callable[[_Undo], None]:
    def load(undo: _Undo) -> None:
        sections = loaded & set(IN_PLACE)

        def put_back() -> None:
            if not fill.unfill():
                raise CheckpointError(
                    f"the {' and '.join(sorted(sections))} tensors read in place may hold "
                    "part of the checkpoint's values (re-reading the verified bytes failed) "
                    "and cannot be rolled back"
                )

        undo.push(put_back)
        fill.fill(sections)

    return load


def _local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's data (a DTensor's local shard)."""
    return getattr(tensor, "_local_tensor", tensor)


def _rng_load(state: dict[str, Any], skip: set[str]) -> Callable[[_Undo], None]:
    def load(undo: _Undo) -> None:
        before = capture_rng()
        if "cuda" in state and torch.cuda.is_available() and "cuda" not in skip:
            before["cuda"] = torch.cuda.get_rng_state_all()
        undo.push(lambda: restore_rng(before))
        restore_rng(state, skip)

    return load


def _extra_load(extra: dict[str, Any], state: dict[str, Any]) -> Callable[[_Undo], None]:
    def load(undo: _Undo) -> None:
        before = _deep_copy(extra)

        def put_back() -> None:
            extra.clear()
            extra.update(before)

        undo.push(put_back)
        extra.clear()
        extra.update(state)

    return load
