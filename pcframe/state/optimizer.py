"""Whether a saved optimizer ``state_dict()`` fits the live optimizer, before it is loaded.

``Optimizer.load_state_dict`` checks only the number and sizes of the param groups: it takes
another class's state (Adam's into SGD) and the step fails later (``KeyError: 'momentum'``),
or silently starts fresh moments. After a load the optimizer runs with the *saved* param
groups' hyperparameters and the *saved* per-parameter state, so this checks exactly that
pair against the live class:

* the class, when the version names it (``optimizer_class`` next to the state);
* param groups: count and sizes; where the version names each position's parameter
  (``optimizer_param_names``), the saved positions are first put in the live order of
  those names (:func:`align_to_names`): torch keys the state by position;
* hyperparameters: every key the live class reads (its ``defaults`` and the live groups'
  keys) is in each saved group, except those the class's own ``__setstate__`` fills in
  (torch's path for checkpoints of older torch versions, found on a scratch instance);
* per-parameter state: every key a step of the live class with the saved hyperparameters
  creates is in the saved state, and state shaped like its parameter has that parameter's
  shape (and dtype, unless ``allow_cast``). The keys a step creates are found by one step
  of a scratch optimizer of the same class over tiny scratch parameters (torch's own
  optimizers only, whose step has no side effects; no hooks run). For other classes, or
  when the scratch step fails, the live optimizer's own state for that parameter (if any)
  is the reference. A restore starts the scratch step with the live hyperparameters
  while it reads the checkpoint (:func:`prefetch_fresh_state`); what a step found is kept
  by class, hyperparameters and the parameters' ranks, dtypes and devices.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Any

import torch
import torch.optim.optimizer as optimizer_module
from torch.optim.optimizer import Optimizer

from pcframe.state.objects import class_name, optimizer_param_names

PRIME_DIMS = (2, 3, 5, 7, 11, 13)  # scratch parameter sizes: a state shaped like it is telling
GROUP_BOOKKEEPING = {"params", "param_names"}


def align_to_names(
    state: Any, saved: Any, model: Any, optimizer: Optimizer
) -> tuple[Any, list[str]]:
    """The saved optimizer ``state`` with each param group's positions put in the live order
    of the parameters' names, and why it cannot be (empty when it can).

    torch keys optimizer state by position, so an optimizer built from the same parameters
    in another order (modules registered in another order) would load each moment into
    another parameter. ``saved`` is the version's ``optimizer_param_names`` (absent in
    versions written before it was stored: positions are all there is). Where a group holds
    the same named parameters on both sides, its saved ``params`` (and torch's own
    ``param_names``) are permuted to the live order; a name on one side only (a renamed
    layer) is a problem, since its moments belong to no live parameter. Positions without a
    name (a parameter outside the model) are compared by position.
    """
    if not (isinstance(saved, list) and all(isinstance(g, list) for g in saved)):
        return state, []
    groups = state.get("param_groups") if isinstance(state, dict) else None
    live = optimizer_param_names(model, optimizer)
    if (
        not isinstance(groups, list)
        or len(groups) != len(saved)
        or [len(g) for g in saved] != [len(g) for g in live]
        or any(not isinstance(g, dict) or not isinstance(g.get("params"), list) for g in groups)
        or [len(g["params"]) for g in groups] != [len(g) for g in saved]
    ):
        return state, []  # the groups differ in number or size: check_optimizer says so
    aligned = []
    for index, (group, was, now) in enumerate(zip(groups, saved, live, strict=True)):
        order, problem = _permutation(was, now)
        if problem:
            return state, [f"optimizer param group {index}: {problem}"]
        if order is None:
            aligned.append(group)
            continue
        group = {**group, "params": [group["params"][i] for i in order]}
        names = group.get("param_names")
        if isinstance(names, list) and len(names) == len(order):
            group["param_names"] = [names[i] for i in order]
        aligned.append(group)
    return {**state, "param_groups": aligned}, []


def _permutation(was: list[Any], now: list[Any]) -> tuple[list[int] | None, str | None]:
    """For each live position, the saved position of the same parameter (``None``: the same
    order already), or why there is none."""
    if was == now:
        return None, None
    gone = [n for n in was if isinstance(n, str) and n not in now]
    new = [n for n in now if isinstance(n, str) and n not in was]
    if gone or new:
        return None, (
            f"the checkpoint holds state of {gone} and none of {new}: those moments belong "
            "to parameters this model does not have by those names (a renamed layer?); "
            "restore with strict=False to leave the optimizer as it is"
        )
    named = [n for n in was if isinstance(n, str)]
    unnamed_stay = [isinstance(n, str) for n in was] == [isinstance(n, str) for n in now]
    if len(set(named)) != len(named) or not unnamed_stay:
        return None, (
            "its parameters are in another order and not all of them have a name of their "
            "own in the model: build the optimizer from the parameters in the saved order"
        )
    where = {name: i for i, name in enumerate(was) if isinstance(name, str)}
    return [where[name] if isinstance(name, str) else i for i, name in enumerate(now)], None


def check_optimizer(
    optimizer: Optimizer,
    saved: Any,
    saved_class: str | None,
    allow_cast: bool,
    problems: list[str],
) -> Any:
    """Append to ``problems`` why ``saved`` does not fit ``optimizer``; return ``saved``."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not (
        isinstance(saved, dict)
        and isinstance(saved.get("state"), dict)
        and isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    ):
        problems.append("optimizer: the checkpoint's state is not an optimizer state_dict()")
        return saved
    cls = type(optimizer)
    name = class_name(optimizer)
    if saved_class is not None and saved_class != name:
        problems.append(f"optimizer: saved from a {saved_class}, this optimizer is a {name}")
    live_groups = optimizer.param_groups
    if len(groups) != len(live_groups):
        problems.append(
            f"optimizer: {len(groups)} param groups in the checkpoint, {len(live_groups)} here"
        )
        return saved
    sizes = [
        (len(g["params"]), len(lg["params"])) for g, lg in zip(groups, live_groups, strict=True)
    ]
    if any(a != b for a, b in sizes):
        listed = ", ".join(f"group {i}: {a} vs {b}" for i, (a, b) in enumerate(sizes) if a != b)
        problems.append(f"optimizer: param group sizes differ (checkpoint vs here: {listed})")
        return saved
    filled = _filled_by_setstate(cls)
    for index, (group, live_group) in enumerate(zip(groups, live_groups, strict=True)):
        needed = (set(optimizer.defaults) | set(live_group)) - GROUP_BOOKKEEPING - filled
        lacking = sorted(needed - set(group))
        if lacking:
            problems.append(
                f"optimizer param group {index}: lacks hyperparameters {lacking} that "
                f"{cls.__name__} reads (the state of another optimizer class?)"
            )
    params: dict[Any, torch.Tensor] = {}
    for group, live_group in zip(groups, live_groups, strict=True):
        params.update(zip(group["params"], live_group["params"], strict=True))
    fresh = _fresh_state(optimizer, groups)
    found: dict[str, list[Any]] = {}  # problem -> the saved parameter ids it concerns
    for saved_id, entry in saved["state"].items():
        param = params.get(saved_id)
        if param is None:
            found.setdefault("is state of no parameter any param group lists", []).append(saved_id)
            continue
        if not isinstance(entry, dict):
            found.setdefault("is not a dict", []).append(saved_id)
            continue
        if fresh is not None:
            expected, made = fresh.get(param), "a step of"
        else:
            expected, made = _reference(optimizer.state.get(param), param), "the live"
        if expected is None:
            continue
        lacking = sorted(set(expected) - set(entry))
        if lacking:
            problem = (
                f"lacks {lacking}, which {made} {cls.__name__} has (the state of another "
                "optimizer class or setup?)"
            )
            found.setdefault(problem, []).append(saved_id)
        for key, value in entry.items():
            like_param = expected.get(key)
            if isinstance(value, torch.Tensor) and like_param is not None:
                problem = _state_misfit(value, param, like_param, allow_cast)
                if problem:
                    found.setdefault(f"[{key!r}]: {problem}", []).append(saved_id)
    for problem, ids in found.items():
        which = (
            f"parameter {ids[0]!r}" if len(ids) == 1 else f"parameters {', '.join(map(repr, ids))}"
        )
        problems.append(f"optimizer state of {which}: {problem}")
    return saved


def _state_misfit(
    value: torch.Tensor, param: torch.Tensor, like: tuple[bool, bool], allow_cast: bool
) -> str | None:
    same_shape, same_dtype = like
    if same_shape and tuple(value.shape) != tuple(param.shape):
        return (
            f"shape {tuple(value.shape)} in the checkpoint, its parameter's is {tuple(param.shape)}"
        )
    if same_dtype and value.dtype != param.dtype and not allow_cast:
        return f"dtype {value.dtype} in the checkpoint, its parameter's is {param.dtype}"
    return None


def _reference(state: Any, param: torch.Tensor) -> dict[str, tuple[bool, bool]] | None:
    """The live state of ``param`` as a reference: key -> (shaped like it, its dtype)."""
    if not state:
        return None
    return {
        key: (
            (tuple(v.shape) == tuple(param.shape), v.dtype == param.dtype)
            if isinstance(v, torch.Tensor)
            else (False, False)
        )
        for key, v in state.items()
    }


@functools.cache
def _filled_by_setstate(cls: type) -> frozenset[str]:
    """Group keys the class's ``__setstate__`` supplies when a saved group lacks them."""
    group: dict[str, Any] = {"params": []}
    try:
        scratch = cls.__new__(cls)
        scratch.__setstate__({"defaults": {}, "state": {}, "param_groups": [group]})
    except Exception:  # a class whose __setstate__ needs more: every key is needed
        return frozenset()
    return frozenset(group) - GROUP_BOOKKEEPING


def prefetch_fresh_state(optimizer: Any) -> threading.Thread | None:
    """Start finding, on a thread of its own, the state a first step of ``optimizer``'s class
    creates with its live hyperparameters, so that the check finds it ready.

    A restore starts it before reading: in a restarted job the scratch step is the process's
    first optimizer step, whose kernels' code is still on disk (40-50 ms on a cold page
    cache, measured), and that overlaps with reading the checkpoint. The caller joins the
    thread before checking; a checkpoint whose saved hyperparameters differ from the live
    ones is checked with a step of its own.
    """
    if not isinstance(optimizer, Optimizer):
        return None
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

    def find() -> None:
        # Warning filters are shared by every thread: this one leaves them alone, so a
        # warning of the scratch step shows (as the same optimizer's own step's would).
        with contextlib.suppress(Exception):  # the check itself reports what goes wrong
            _fresh_state(optimizer, groups, quiet=False)

    thread = threading.Thread(target=find, name="pcframe-fresh-state", daemon=True)
    thread.start()
    return thread


# Fresh states found, by _fresh_key (a few: one optimizer setup per restore, in practice).
_FOUND: dict[tuple[Any, ...], list[dict[str, tuple[bool, bool]]]] = {}
_FOUND_MAX = 8


def _hyperparameters(live_group: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
    """The saved hyperparameters, as after a load; the live ones where the saved lack one."""
    hyper = {**live_group, **group}
    return {k: v for k, v in hyper.items() if k not in GROUP_BOOKKEEPING}


# Hyperparameters a learning-rate schedule moves and no torch optimizer's state keys depend
# on: left out of the key, so a restore after a decayed rate still finds the prefetched step.
SCHEDULED = frozenset({"lr", "initial_lr"})


def _fresh_key(optimizer: Optimizer, groups: list[dict[str, Any]]) -> tuple[Any, ...]:
    """What a fresh state depends on: the class, each group's hyperparameters (but the
    learning rate), and each parameter's rank, dtype and device (the scratch parameters
    mirror nothing else)."""
    return (
        type(optimizer),
        tuple(
            (
                repr(
                    sorted(
                        (k, v)
                        for k, v in _hyperparameters(live_group, group).items()
                        if k not in SCHEDULED
                    )
                ),
                tuple((p.dim(), p.dtype, p.device) for p in live_group["params"]),
            )
            for group, live_group in zip(groups, optimizer.param_groups, strict=True)
        ),
    )


def _fresh_state(
    optimizer: Optimizer, groups: list[dict[str, Any]], *, quiet: bool = True
) -> dict[Any, Any] | None:
    """Per live parameter, the state a first step of its class would create (see above);
    ``quiet`` silences the scratch step's warnings (on the calling thread only)."""
    cls = type(optimizer)
    global_hooks = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    if not f"{cls.__module__}.".startswith("torch.optim.") or any(
        getattr(optimizer_module, name, None) for name in global_hooks
    ):
        return None
    params = [p for live_group in optimizer.param_groups for p in live_group["params"]]
    key = _fresh_key(optimizer, groups)
    found = _FOUND.get(key)
    if found is None:
        found = _scratch_step(optimizer, groups, quiet)
        if found is None:
            return None
        if len(_FOUND) >= _FOUND_MAX:
            _FOUND.clear()
        _FOUND[key] = found
    return dict(zip(params, found, strict=True))


def _scratch_step(
    optimizer: Optimizer, groups: list[dict[str, Any]], quiet: bool
) -> list[dict[str, tuple[bool, bool]]] | None:
    """One step of a scratch optimizer of the class over tiny stand-ins of the parameters:
    per parameter, in order, each state key and whether it is shaped like / typed like it."""
    cls = type(optimizer)
    scratches: list[torch.Tensor] = []
    scratch_groups = []
    try:
        for group, live_group in zip(groups, optimizer.param_groups, strict=True):
            scratch_params = []
            for param in live_group["params"]:
                shape = (
                    PRIME_DIMS[: param.dim()]
                    if param.dim() <= len(PRIME_DIMS)
                    else (1,) * param.dim()
                )
                scratch = torch.zeros(
                    shape, dtype=param.dtype, device=param.device, requires_grad=True
                )
                scratch.grad = torch.full_like(scratch, 1e-3, requires_grad=False)
                scratch_params.append(scratch)
                scratches.append(scratch)
            scratch_groups.append({**_hyperparameters(live_group, group), "params": scratch_params})
        with warnings.catch_warnings(action="ignore") if quiet else contextlib.nullcontext():
            scratch_optimizer = cls(scratch_groups)
            scratch_optimizer.step(lambda: torch.zeros(()))
    except Exception:  # e.g. sparse gradients needed, or a setup the scratch cannot mirror
        return None
    found = []
    for scratch in scratches:
        state = scratch_optimizer.state.get(scratch)
        found.append(
            {
                key: (
                    (tuple(v.shape) == tuple(scratch.shape), v.dtype == scratch.dtype)
                    if isinstance(v, torch.Tensor)
                    else (False, False)
                )
                for key, v in (state or {}).items()
            }
        )
    return found
