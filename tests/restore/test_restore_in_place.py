"""Restore reads the model's and optimizer's tensors straight into their live storage.

And it stays all-or-nothing: the reader verifies every chunk before it writes a byte of a
live tensor, the bytes are written last, after every object loaded; a damaged or
mismatching version leaves the objects exactly as they were, and an object whose loading
is not plain torch (a load hook, an override) is loaded the ordinary way.
"""

from __future__ import annotations

import pytest
import torch

from pcframe import Checkpointer
from pcframe.errors import CheckpointError, NoValidCheckpoint
from pcframe.state.in_place import in_place_targets, plain_module_loading


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


def _moments(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (i, key): value
        for i, state in enumerate(optimizer.state.values())
        for key, value in state.items()
        if key != "step"
    }


def test_model_and_optimizer_are_read_into_their_own_storage(tmp_path):
    model = _model()
    optimizer = _trained(model)
    saved = _snapshot(model)
    saved_moments = {k: v.clone() for k, v in _moments(optimizer).items()}
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    pointers = {k: v.data_ptr() for k, v in model.state_dict().items()}
    moment_pointers = {k: v.data_ptr() for k, v in _moments(optimizer).items()}
    _perturb(model)
    model(torch.randn(8, 256)).sum().backward()
    optimizer.step()  # the moments move on too
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.restore()
        report = ckpt.last_restore
    assert _same(model, saved)
    assert all(torch.equal(v, saved_moments[k]) for k, v in _moments(optimizer).items())
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == pointers
    assert {k: v.data_ptr() for k, v in _moments(optimizer).items()} == moment_pointers
    expected = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    expected += sum(v.numel() * v.element_size() for v in saved_moments.values())
    assert report is not None and report.in_place_bytes == expected


def test_a_refused_optimizer_keeps_its_state_while_the_model_loads(tmp_path):
    model = _model()
    optimizer = _trained(model)
    saved = _snapshot(model)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    other = torch.optim.Adam(model.parameters(), lr=1e-2)  # AdamW was saved: refused
    model(torch.randn(8, 256)).sum().backward()
    other.step()
    _perturb(model)
    before = {k: v.clone() for k, v in _moments(other).items()}
    with Checkpointer(tmp_path, model=model, optimizer=other) as ckpt:
        not_loaded = ckpt.restore(strict=False) and ckpt.last_restore.not_loaded
    assert any("optimizer" in line for line in not_loaded)
    assert _same(model, saved)
    assert all(torch.equal(v, before[k]) for k, v in _moments(other).items())


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
    assert not plain_module_loading(model) and in_place_targets(model, optimizer) == {}
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
    assert not any(n.startswith("model/") for n in in_place_targets(model, optimizer))
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
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = optimizer.state[model.bias]
    state["exp_avg_sq"] = state["exp_avg_sq"].double()  # not its parameter's dtype
    targets = in_place_targets(model, optimizer)
    # the weight and its moments (made like it) are strided; exp_avg_sq is float64
    assert set(targets) == {"model/bias", "optimizer/state/1/exp_avg"}


class Complex(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(weight)


def test_a_parameter_with_a_lazy_conjugate_is_loaded_the_ordinary_way(tmp_path):
    """Its bytes are not its values: reading into its storage failed on the second read and
    reported a rollback failure, though nothing had been changed."""
    torch.manual_seed(0)
    saved = Complex(torch.randn(4, dtype=torch.complex64))
    with Checkpointer(tmp_path, model=saved) as ckpt:
        ckpt.save(step=1).wait()
    live = Complex(torch.randn(4, dtype=torch.complex64).conj())
    assert in_place_targets(live, None) == {}
    with Checkpointer(tmp_path, model=live) as ckpt:
        assert ckpt.restore() == 1
    assert torch.equal(live.w.detach().resolve_conj(), saved.w.detach())


def test_a_model_still_on_the_meta_device_is_refused_not_reported_loaded(tmp_path):
    with Checkpointer(tmp_path, model=torch.nn.Linear(3, 2)) as ckpt:
        ckpt.save(step=1).wait()
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 2)
    with Checkpointer(tmp_path, model=meta) as ckpt:
        with pytest.raises(CheckpointError, match=r"model\['weight'\].*meta device.*to_empty"):
            ckpt.restore()
        assert ckpt.restore(strict=False) == 1
        assert any("meta device" in line for line in ckpt.last_restore.not_loaded)
    meta.to_empty(device="cpu")
    with Checkpointer(tmp_path, model=meta) as ckpt:
        assert ckpt.restore() == 1


def test_an_optimizer_with_a_load_hook_is_loaded_the_ordinary_way():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.register_load_state_dict_pre_hook(lambda opt, state: state)
    assert not any(name.startswith("optimizer/") for name in in_place_targets(model, optimizer))


def test_a_failing_second_read_says_what_could_not_be_rolled_back(tmp_path, monkeypatch):
    import errno

    from pcframe.restore import reader

    model = _model()
    optimizer = _trained(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        ckpt.save(1).wait()
    optimizer.step()
    scheduler.step()
    scheduler_before = scheduler.state_dict()

    def broken(self, chunk, flats):
        raise OSError(errno.EIO, "Input/output error", str(self.data_path))

    monkeypatch.setattr(reader._VersionReader, "_read_pieces", broken)
    with (
        Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) as ckpt,
        pytest.raises(CheckpointError, match="cannot be rolled back"),
    ):
        ckpt.restore()
    assert scheduler.state_dict() == scheduler_before  # what can be rolled back was


class Scaled(torch.nn.Module):
    """A module with tensor extra state: set from the state dict inside load_state_dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.ones(4)

    def get_extra_state(self):
        return {"scale": self.scale.clone()}

    def set_extra_state(self, state) -> None:
        self.scale = state["scale"].clone()


def test_extra_state_is_restored(tmp_path):
    model = Scaled()
    model.scale.fill_(2.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    model.scale.fill_(7.0)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.restore()
    assert torch.equal(model.scale, torch.full((4,), 2.0))


def test_a_state_dict_of_copies_is_restored_into_the_parameters(tmp_path):
    model = torch.nn.Linear(3, 1, bias=False)

    def as_bf16(module, state, prefix, local_metadata):  # hands out copies, not the storage
        for key in list(state):
            state[key] = state[key].to(torch.bfloat16)

    model._register_state_dict_hook(as_bf16)
    with torch.no_grad():
        model.weight.fill_(0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    with torch.no_grad():
        model.weight.fill_(3.0)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.restore(allow_cast=True)
    assert torch.equal(model.weight, torch.full((1, 3), 0.5))


def test_a_version_deleted_after_verification_still_fills(tmp_path, monkeypatch):
    from pcframe.restore import restorer

    model = _model()
    optimizer = _trained(model)
    saved = _snapshot(model)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    _perturb(model)
    real_apply = restorer.apply_tree

    def delete_then_apply(*args, **kwargs):
        for data in tmp_path.glob("v*/data.bin"):
            data.unlink()  # e.g. another process's retention, between verification and fill
        return real_apply(*args, **kwargs)

    monkeypatch.setattr(restorer, "apply_tree", delete_then_apply)
    import pcframe

    pcframe.load(tmp_path, model=model, optimizer=optimizer)
    assert _same(model, saved)


def test_a_forked_child_can_restore_after_its_parent(tmp_path):
    import multiprocessing

    model = _model()
    optimizer = _trained(model)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    import pcframe

    pcframe.load(tmp_path, model=model, optimizer=optimizer)  # the parent's reading pool

    def child() -> None:
        # No OpenMP team in the child: GNU OpenMP itself can hang after a fork (not ours).
        torch.set_num_threads(1)
        pcframe.load(tmp_path, model=model, optimizer=optimizer)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(60)
    alive = process.is_alive()
    if alive:
        process.kill()
    assert not alive and process.exitcode == 0


def test_a_model_restored_into_its_own_tensors_is_not_walked_by_load_state_dict(
    tmp_path, monkeypatch
):
    # Every value the apply would hand to load_state_dict is the parameter or buffer itself
    # (filled last): the call would copy each onto itself, so it is skipped. The values are
    # still the checkpoint's, a non-persistent buffer (not in the state dict) is left alone.
    model = _model()
    model.register_buffer("scratch", torch.full((3,), 7.0), persistent=False)
    optimizer = _trained(model)
    saved = _snapshot(model)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    _perturb(model)
    model.scratch.fill_(5.0)
    calls = []
    original = torch.nn.Module.load_state_dict

    def counted(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", counted)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.restore()
    assert calls == []
    assert _same(model, saved)
    assert torch.equal(model.scratch, torch.full((3,), 5.0))


def test_a_model_given_fresh_values_for_some_tensors_is_loaded_by_load_state_dict(
    tmp_path, monkeypatch
):
    # A half-precision copy of the weights in the checkpoint (allow_cast): those values are
    # fresh tensors, so load_state_dict runs and casts them into the parameters.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with Checkpointer(tmp_path, model=model.half()) as ckpt:
        ckpt.save(1).wait()
    saved = model[0].weight.detach().clone()
    model.float()
    calls = []
    original = torch.nn.Module.load_state_dict
    monkeypatch.setattr(
        torch.nn.Module,
        "load_state_dict",
        lambda self, *a, **k: calls.append(1) or original(self, *a, **k),
    )
    with Checkpointer(tmp_path, model=model) as ckpt:
        ckpt.restore(allow_cast=True)
    assert calls == [1]
    assert torch.equal(model[0].weight, saved.float())


def test_a_restore_holds_off_the_cyclic_collector_and_gives_it_back(tmp_path):
    import gc

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    optimizer = _trained_small(model)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
    seen = []
    model.register_load_state_dict_post_hook(lambda *_: seen.append(gc.isenabled()))
    assert gc.isenabled()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.restore()
        assert seen == [False] and gc.isenabled()
        gc.disable()  # a program that runs without it keeps it off
        try:
            ckpt.restore()
            assert seen == [False, False] and not gc.isenabled()
        finally:
            gc.enable()


def test_a_graph_built_before_a_restore_refuses_backward_after_it(tmp_path):
    # The fill writes the parameters' memory where autograd cannot see it: their version
    # counts move on as for any in-place write, so a loss computed before the restore
    # cannot back-propagate through the restored weights.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = _trained_small(model)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()
        _perturb(model)
        loss = model(torch.randn(4, 8)).pow(2).sum()
        ckpt.restore()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_a_fallback_past_a_damaged_version_frees_its_tensors_first(tmp_path):
    # Every entry read into fresh tensors (a load hook): the damaged newest version's, held
    # in a cycle by its exception, are freed before the older version is read and applied.
    import gc

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(16)])
    model.register_load_state_dict_post_hook(lambda *_: None)
    alive: list[int] = []

    class Probe:
        def state_dict(self):
            return {"x": 1}

        def load_state_dict(self, state):
            big = {
                o.untyped_storage().data_ptr()
                for o in gc.get_objects()
                if type(o) in (torch.Tensor, torch.nn.Parameter) and o.numel() == 256 * 256
            }
            alive.append(len(big))

    engine = {"chunk_bytes": 1 << 16}  # many chunks: read by the reading threads
    with Checkpointer(tmp_path, model=model, stateful={"probe": Probe()}, **engine) as ckpt:
        ckpt.save(1).wait()
        ckpt.save(2).wait()
    data = tmp_path / "v00000002" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with Checkpointer(tmp_path, model=model, stateful={"probe": Probe()}, **engine) as ckpt:
        ckpt.restore()
        assert [v for v, _ in ckpt.last_restore.skipped] == [2]
    assert alive == [32]  # the model's 16 weights and version 1's 16: none of version 2's
