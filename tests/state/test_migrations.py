"""Models that migrate old state the torch way restore as ``torch.save`` + ``load_state_dict``
would: load pre-hooks that rename keys, and modules that read their saved ``_version``."""

from __future__ import annotations

import pytest
import torch

from pcframe import Checkpointer
from pcframe.errors import CheckpointError


class OldNorm(torch.nn.Module):
    """Version 1 of a layer: its scale was called ``gamma``."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = torch.nn.Parameter(torch.randn(6))
        self.bias = torch.nn.Parameter(torch.randn(6))


class NewNorm(torch.nn.Module):
    """Version 2: ``gamma`` is ``weight`` now; a load pre-hook renames old checkpoints' key."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(6))
        self.bias = torch.nn.Parameter(torch.zeros(6))
        self.register_load_state_dict_pre_hook(self._rename)

    @staticmethod
    def _rename(module, state_dict, prefix, *_):
        if prefix + "gamma" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "gamma")


def net(norm: type[torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), norm())


def save_once(root, model) -> dict[str, torch.Tensor]:
    with Checkpointer(root, model=model) as ckpt:
        ckpt.save(1)
        ckpt.wait()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_load_pre_hook_migrates_an_old_checkpoint(tmp_path):
    saved = save_once(tmp_path, net(OldNorm))
    model = net(NewNorm)
    reference = net(NewNorm)
    reference.load_state_dict(saved)
    with Checkpointer(tmp_path, model=model) as ckpt:
        assert ckpt.restore() == 1
    assert torch.equal(model[1].weight, saved["1.gamma"])
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_what_the_hooks_leave_unmatched_is_still_refused_and_changes_nothing(tmp_path):
    save_once(tmp_path, net(OldNorm))

    class Wider(NewNorm):  # the hook renames, but the shape differs: a real mismatch
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(7))

    model = torch.nn.Sequential(torch.nn.Linear(6, 6), Wider())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with (
        Checkpointer(tmp_path, model=model) as ckpt,
        pytest.raises(CheckpointError, match=r"model\['1.weight'\]: shape \(6,\)"),
    ):
        ckpt.restore()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_hook_that_raises_is_named_and_changes_nothing(tmp_path):
    save_once(tmp_path, net(OldNorm))
    model = net(NewNorm)

    def broken(module, state_dict, prefix, *_):
        raise KeyError("scale")

    model[1].register_load_state_dict_pre_hook(broken)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with (
        Checkpointer(tmp_path, model=model) as ckpt,
        pytest.raises(CheckpointError, match=r"pre-hook raised.*KeyError"),
    ):
        ckpt.restore()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_strict_false_with_hooks_loads_what_fits(tmp_path):
    save_once(tmp_path, net(OldNorm))

    class Extra(NewNorm):
        def __init__(self) -> None:
            super().__init__()
            self.shift = torch.nn.Parameter(torch.full((6,), 3.0))

    model = torch.nn.Sequential(torch.nn.Linear(6, 6), Extra())
    saved = net(OldNorm).state_dict()
    with Checkpointer(tmp_path, model=model) as ckpt:
        assert ckpt.restore(strict=False) == 1
        assert any("1.shift" in line for line in ckpt.last_restore.not_loaded)
    assert torch.equal(model[1].weight, saved["1.gamma"])
    assert torch.equal(model[1].shift, torch.full((6,), 3.0))


class Versioned(torch.nn.Module):
    """A layer whose version 1 stored its weight transposed; version 2 migrates on load."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if local_metadata.get("version", 1) < 2:
            state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_a_module_version_is_kept_so_a_current_checkpoint_is_not_migrated_again(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Versioned())
    saved = save_once(tmp_path, model)
    with torch.no_grad():
        model[0].weight.zero_()
    with Checkpointer(tmp_path, model=model) as ckpt:
        assert ckpt.restore() == 1
    # Without the version, the layer reads version 1 and transposes its own weight.
    assert torch.equal(model[0].weight, saved["0.weight"])


def test_a_version_1_checkpoint_is_migrated(tmp_path):
    class Old(Versioned):
        _version = 1

    torch.manual_seed(0)
    saved = save_once(tmp_path, torch.nn.Sequential(Old()))
    model = torch.nn.Sequential(Versioned())
    with Checkpointer(tmp_path, model=model) as ckpt:
        assert ckpt.restore() == 1
    assert torch.equal(model[0].weight, saved["0.weight"].t())


def test_a_model_that_is_not_a_module_is_refused_before_anything_is_saved(tmp_path):
    """An object with only state_dict() / load_state_dict() saved as model= and then could
    not be restored (the load goes through parameters and buffers): refused up front, with
    the fix (stateful= restores it), and nothing locked."""

    class Weights:
        def __init__(self) -> None:
            self.w = torch.zeros(3)

        def state_dict(self):
            return {"w": self.w}

        def load_state_dict(self, state, strict=True):
            self.w.copy_(state["w"])

    with pytest.raises(TypeError, match=r"model= is a Weights, not a torch.nn.Module.*stateful="):
        Checkpointer(tmp_path, model=Weights())
    weights = Weights()
    weights.w += 5
    with Checkpointer(tmp_path, stateful={"weights": weights}) as ckpt:
        ckpt.save(1).wait()
        weights.w.zero_()
        assert ckpt.restore() == 1
    assert torch.equal(weights.w, torch.full((3,), 5.0))


def test_a_partial_load_runs_each_migration_once(tmp_path):
    """strict=False with a key the checkpoint lacks: the values that fit had gone through the
    hooks already, and load_state_dict ran them again (a transpose applied twice)."""

    class Old(torch.nn.Module):
        _version = 1

        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4, bias=False)

    class New(Old):
        _version = 2

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("added", torch.zeros(1))  # new in version 2
            self.register_load_state_dict_pre_hook(self._migrate)

        @staticmethod
        def _migrate(module, state, prefix, local_metadata, *_):
            if local_metadata.get("version", 1) < 2 and prefix + "lin.weight" in state:
                state[prefix + "lin.weight"] = state[prefix + "lin.weight"].t().contiguous()

    torch.manual_seed(0)
    old = Old()
    saved = save_once(tmp_path, old)
    reference = New()
    reference.load_state_dict(saved, strict=False)  # torch: the hook runs once
    model = New()
    with Checkpointer(tmp_path, model=model) as ckpt:
        assert ckpt.restore(strict=False) == 1
    assert torch.equal(model.lin.weight, reference.lin.weight)
    assert torch.equal(model.lin.weight, saved["lin.weight"].t())
    assert model._load_state_dict_pre_hooks  # put back after the load
