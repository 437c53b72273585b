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

That is the same as an ordinary load only where loading is plain torch: a module with its
own ``_load_from_state_dict`` (outside torch) or with load-state-dict hooks, or an optimizer
with its own ``load_state_dict`` or load hooks, may transform what it is given, so those
objects load the ordinary way. Per tensor: a plain CPU tensor, contiguous and non-empty
(the reader also checks dtype and shape against the manifest); for optimizer state only
tensors with their parameter's dtype (others torch would convert into a new tensor), and
never the ``step`` counters (tiny, and torch may convert them). GPU, sharded (DTensor) and
strided tensors take the ordinary path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import Optimizer

from pcframe.format.tree import TensorRef, encode_tree

SECTIONS = ("model", "optimizer")  # the tree sections whose tensors may be read in place


def in_place_targets(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """``{manifest entry name: live tensor}`` for the tensors a restore may fill in place."""
    targets: dict[str, torch.Tensor] = {}
    if isinstance(model, torch.nn.Module) and plain_module_loading(model):
        targets.update(_named({"model": model.state_dict()}))
    if isinstance(optimizer, Optimizer) and plain_optimizer_loading(optimizer):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = optimizer.state_dict()["state"]
        fitting = {
            index: {
                key: value
                for key, value in per_param.items()
                if key != "step"
                and isinstance(value, torch.Tensor)
                and index < len(params)
                and value.dtype == params[index].dtype
                and value.device == params[index].device
            }
            for index, per_param in state.items()
        }
        targets.update(_named({"optimizer": {"state": fitting}}))
    return targets


def _named(tree: dict[str, Any]) -> dict[str, torch.Tensor]:
    refs: list[TensorRef] = []
    encode_tree(tree, "", refs)  # the names capture gives the same tensors
    return {
        ref.path.lstrip("/"): ref.tensor
        for ref in refs
        if type(ref.tensor) is torch.Tensor
        and ref.tensor.device.type == "cpu"
        and ref.tensor.is_contiguous()
        and ref.tensor.numel()
        and not ref.numpy
    }


def plain_module_loading(model: torch.nn.Module) -> bool:
    """True when ``model.load_state_dict`` only copies values (no hook, no override)."""
    if type(model).load_state_dict is not torch.nn.Module.load_state_dict:
        return False
    for module in model.modules():
        if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
            return False
        if not type(module)._load_from_state_dict.__module__.startswith("torch."):
            return False
    return True


def plain_optimizer_loading(optimizer: Optimizer) -> bool:
    """True when the optimizer loads with torch's own ``load_state_dict`` and no hooks."""
    return (
        type(optimizer).load_state_dict is Optimizer.load_state_dict
        and type(optimizer)._process_value_according_to_param_policy
        is Optimizer._process_value_according_to_param_policy
        and not optimizer._optimizer_load_state_dict_pre_hooks
        and not optimizer._optimizer_load_state_dict_post_hooks
    )
