"""Which live tensors a restore may read straight into: the model's, where nothing can differ.

Reading a version into fresh tensors and then copying them into the model costs a whole
fresh allocation of the model's bytes (page faults), one more pass over them, and, for the
all-or-nothing apply, a host copy of the old weights to roll back to. Instead the reader
verifies every chunk first and only then reads the model's bytes a second time, from the
page cache, into the parameters' own storage (:func:`~pcframe.restore.reader.load_version`
with ``targets``); ``model.load_state_dict`` then sees tensors that already are the
parameters (each ``copy_`` onto itself returns at once) and runs its checks and hooks.

That is only the same as a normal load where loading is plain torch: a module with its own
``_load_from_state_dict`` (outside torch) or with load-state-dict hooks may transform what it
is given, so such a model is loaded the ordinary way. Per tensor, only a plain CPU tensor,
contiguous, of the saved dtype and shape is read in place (the reader checks dtype and
shape against the manifest); GPU, sharded (DTensor) and strided tensors take the ordinary
path.
"""

from __future__ import annotations

import torch

from pcframe.format.tree import TensorRef, encode_tree


def in_place_targets(model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """``{manifest entry name: live tensor}`` for the model tensors a restore may fill."""
    if model is None or not plain_loading(model):
        return {}
    refs: list[TensorRef] = []
    encode_tree({"model": model.state_dict()}, "", refs)  # the names capture gives them
    return {
        ref.path.lstrip("/"): ref.tensor
        for ref in refs
        if type(ref.tensor) is torch.Tensor
        and ref.tensor.device.type == "cpu"
        and ref.tensor.is_contiguous()
        and ref.tensor.numel()
        and not ref.numpy
    }


def plain_loading(model: torch.nn.Module) -> bool:
    """True when ``model.load_state_dict`` only copies values (no hook, no override)."""
    if type(model).load_state_dict is not torch.nn.Module.load_state_dict:
        return False
    for module in model.modules():
        if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
            return False
        if not type(module)._load_from_state_dict.__module__.startswith("torch."):
            return False
    return True
