"""Restore reads the model's tensors straight into their live storage, and stays all-or-nothing.

The reader verifies every chunk before it writes a byte of a live tensor: a damaged or
mismatching version leaves the model exactly as it was, and a model whose loading is not
plain torch (a load hook, an override) is loaded the ordinary way.
"""

from __future__ import annotations

import pytest
import torch

from pcframe import Checkpointer
from pcframe.errors import CheckpointError, NoValidCheckpoint
from pcframe.restore.in_place import in_place_targets, plain_loading


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 4)
    )


def _trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 256)).sum().backward()
    optimizer.step()
    return optimizer


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


def _perturb(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def test_model_is_read_into_its_own_storage(tmp_path):
    model = _model()
    optimizer = _trained(model)
    saved = _snapshot(model)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    pointers = {k: v.data_ptr() for k, v in model.state_dict().items()}
    _perturb(model)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.restore()
        report = ckpt.last_restore
    assert _same(model, saved)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == pointers
    model_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert report is not None and report.in_place_bytes == model_bytes


def test_a_corrupt_version_changes_no_live_tensor(tmp_path):
    model = _model()
    optimizer = _trained(model)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    data = next(tmp_path.glob("v*/data.bin"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # the last chunk: the model's chunks come first and verify
    data.write_bytes(bytes(raw))
    _perturb(model)
    before = _snapshot(model)
    with (
        Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt,
        pytest.raises(NoValidCheckpoint),
    ):
        ckpt.restore()
    assert _same(model, before)


def test_a_mismatch_changes_no_live_tensor(tmp_path):
    model = _model()
    optimizer = _trained(model)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    _perturb(model)
    before = _snapshot(model)
    other = torch.optim.Adam(model.parameters())  # AdamW was saved: refused
    model(torch.randn(8, 256)).sum().backward()
    other.step()
    before = _snapshot(model)
    with (
        Checkpointer(tmp_path, model=model, optimizer=other) as ckpt,
        pytest.raises(CheckpointError),
    ):
        ckpt.restore()
    assert _same(model, before)


class Doubling(torch.nn.Linear):
    """Loads twice the saved weight: a module whose loading is not plain torch."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict = dict(state_dict)
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 2
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def test_a_module_with_its_own_loading_is_loaded_the_ordinary_way(tmp_path):
    model = torch.nn.Sequential(Doubling(8, 8))
    optimizer = _trained_small(model)
    saved = model[0].weight.detach().clone()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    assert not plain_loading(model) and in_place_targets(model) == {}
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.restore()
        assert ckpt.last_restore.in_place_bytes == 0
    assert torch.equal(model[0].weight, saved * 2)  # the override saw the saved values


def test_a_load_hook_sees_the_restored_values(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    optimizer = _trained_small(model)
    saved = model[0].weight.detach().clone()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    _perturb(model)
    seen = []
    model.register_load_state_dict_post_hook(
        lambda module, keys: seen.append(module[0].weight.detach().clone())
    )
    assert in_place_targets(model) == {}
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.restore()
    assert torch.equal(seen[0], saved)


def _trained_small(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return optimizer


def test_only_plain_cpu_contiguous_tensors_are_targets():
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.set_(model.weight.t().contiguous().t())  # a strided parameter
    targets = in_place_targets(model)
    assert set(targets) == {"model/bias"}
