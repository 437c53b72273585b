"""Which live tensors a restore may read straight into: where nothing can differ.

Reading a version into fresh tensors and then loading them costs a whole fresh allocation
of the state (page faults), one more pass over the model's bytes (``load_state_dict``
copies them into the parameters), and, for the all-or-nothing apply, a host copy of the old
weights to roll back to. Instead the reader verifies every chunk first while these
tensors' bytes go to a scratch buffer, the objects load with ``load_state_dict`` given the
live tensors themselves (a parameter's ``copy_`` onto itself returns at once; torch's
optimizer keeps a state tensor that already has its parameter's dtype and device), and only
then, as the last step that can fail, the bytes are read a second time, from the page
cache, into the live storage (:attr:`~pcframe.restore.reader.LoadedVersion.fill`). Until
that last step every object is exactly as before, so a rollback needs no copy.

That is the same as an ordinary load only where saving and loading are plain torch: a
module with its own ``state_dict`` / ``_load_from_state_dict`` / extra state (outside
torch) or with state-dict or load-state-dict hooks, or an optimizer with its own
``state_dict`` / ``load_state_dict`` or such hooks, may hand out copies or transform what
it is given, so those objects load the ordinary way. And a target must *be* the live
storage: a model entry only where the state dict's tensor is the module's own parameter or
persistent buffer of that name (same storage, offset, shape, dtype), an optimizer entry
only where it is the tensor in ``optimizer.state``. Per tensor: a plain CPU tensor,
contiguous and non-empty, without a lazy conjugate or negation bit (the reader also
checks dtype and shape against the manifest);
for optimizer state only tensors with their parameter's dtype (others torch would convert
into a new tensor), and never the ``step`` counters (tiny, and torch may convert them).
GPU, sharded (DTensor) and strided tensors take the ordinary path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import Optimizer


def in_place_targets(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """``{manifest entry name: live tensor}`` for the tensors a restore may fill in place."""
    targets: dict[str, torch.Tensor] = {}
    if isinstance(model, torch.nn.Module) and plain_module_loading(model):
        own = {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False)),
        }
        live = {k: v for k, v in model.state_dict().items() if _is_live(v, own.get(k))}
        targets.update(_named("model/", live))
    if isinstance(optimizer, Optimizer) and plain_optimizer_loading(optimizer):
        # Indices as torch's Optimizer.state_dict numbers them: each group's parameters
        # from a running start (advanced by the group's length), the first index kept.
        index: dict[int, int] = {}
        start = 0
        for group in optimizer.param_groups:
            for i, param in enumerate(group["params"], start):
                index.setdefault(id(param), i)
            start += len(group["params"])
        for param, per_param in optimizer.state.items():
            if not isinstance(param, torch.Tensor) or id(param) not in index:
                continue
            fitting = {
                key: value
                for key, value in per_param.items()
                if key != "step"
                and isinstance(value, torch.Tensor)
                and value.dtype == param.dtype
                and value.device == param.device
            }
            targets.update(_named(f"optimizer/state/{index[id(param)]}/", fitting))
    return targets


def seen_elsewhere(
    targets: Mapping[str, torch.Tensor], model: Any, optimizer: Any
) -> frozenset[str]:
    """Targets whose memory another tensor also covers: another target (tied weights, one
    tensor saved under two names) or a tensor of the objects that is not the target's own
    view (an alias buffer). A restore reading such a target straight in could have another
    thread, or a load's undo, copy its bytes at the wrong moment: it verifies those first."""
    views = {view_of(t) for t in targets.values()}
    others: list[torch.Tensor] = []
    if isinstance(model, torch.nn.Module):
        others += [*model.parameters(), *model.buffers()]
    if isinstance(optimizer, Optimizer):
        others += [v for per in optimizer.state.values() for v in per.values()]
    spans = [(*byte_span(t), name) for name, t in targets.items()]
    spans += [
        (*byte_span(t), None)
        for t in others
        if type(t) in (torch.Tensor, torch.nn.Parameter)  # subclasses may have no data_ptr
        and t.device.type == "cpu"
        and t.numel()
        and view_of(t) not in views
    ]
    return frozenset(overlapping(spans))


def overlapping(spans: Iterable[tuple[int, int, Any]]) -> set[Any]:
    """The keys (not ``None``) of the ``(start, end, key)`` byte ranges that overlap another."""
    found: set[Any] = set()
    active: list[tuple[int, Any]] = []  # (end, key) of the ranges still open
    for start, end, key in sorted(spans, key=lambda s: (s[0], s[1])):
        active = [(e, k) for e, k in active if e > start]
        if active:
            found.update(k for _, k in active)
            found.add(key)
        active.append((end, key))
    found.discard(None)
    return found


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses ``[start, end)`` a tensor's elements can reach."""
    start = t.data_ptr()
    if t.is_contiguous():  # most tensors: no walk over the dimensions
        return start, start + max(t.numel(), 1) * t.element_size()
    reach = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return start, start + (reach + 1) * t.element_size()


def view_of(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same view of the same memory."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _is_live(value: object, own: torch.Tensor | None) -> bool:
    """``value`` (from ``state_dict()``) is the very storage of the module's own tensor: the
    same first byte at the same offset (so the same storage) in the same view."""
    return (
        isinstance(value, torch.Tensor)
        and own is not None
        and view_of(value) == view_of(own)
        and value.storage_offset() == own.storage_offset()
    )


def _named(prefix: str, tensors: dict[Any, Any]) -> dict[str, torch.Tensor]:
    """``{prefix + key: tensor}`` for the values that may be read in place. The names are
    the paths capture gives them (:func:`~pcframe.format.tree.encode_tree` joins a tree's
    keys with ``/``); built here directly, as one level of keys, without encoding the tree
    (a detach per tensor: 3200 tensors cost 10 ms)."""
    return {
        # A Parameter kept in an optimizer's state is read into through a plain view of it.
        f"{prefix}{key}": t.detach() if type(t) is torch.nn.Parameter else t
        for key, t in tensors.items()
        if type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.is_cpu
        and t.is_contiguous()
        and t.numel()
        # Its bytes are not its values (a lazy conjugate or negation): the ordinary load.
        and not (t.is_conj() or t.is_neg())
    }


_MODULE_METHODS = ("_load_from_state_dict", "_save_to_state_dict")
_MODULE_HOOKS = (
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
)


def plain_module_loading(model: torch.nn.Module) -> bool:
    """True when ``state_dict`` / ``load_state_dict`` only hand out and copy values."""
    root = type(model)
    if (
        root.load_state_dict is not torch.nn.Module.load_state_dict
        or root.state_dict is not torch.nn.Module.state_dict
    ):
        return False
    for module in model.modules():
        if any(getattr(module, hooks, None) for hooks in _MODULE_HOOKS):
            return False
        for name in _MODULE_METHODS:
            if not getattr(type(module), name).__module__.startswith("torch."):
                return False
        # Extra state (set_extra_state) is set from the state dict during load_state_dict,
        # before any fill; a module that defines it loads the ordinary way.
        if type(module).get_extra_state is not torch.nn.Module.get_extra_state:
            return False
    return True


def plain_optimizer_loading(optimizer: Optimizer) -> bool:
    """True when the optimizer loads with torch's own ``load_state_dict`` and no hooks."""
    kind = type(optimizer)
    return (
        kind.load_state_dict is Optimizer.load_state_dict
        and kind.state_dict is Optimizer.state_dict
        and kind._process_value_according_to_param_policy
        is Optimizer._process_value_according_to_param_policy
        and not optimizer._optimizer_load_state_dict_pre_hooks
        and not optimizer._optimizer_load_state_dict_post_hooks
        and not optimizer._optimizer_state_dict_pre_hooks
        and not optimizer._optimizer_state_dict_post_hooks
    )
