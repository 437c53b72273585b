"""Tensors the background copy reads in place must keep still until it is done: only
``optimizer.step()`` waits for it. A parameter the optimizer does not step and that changes
(an EMA copy) is cloned at ``save()``; one that keeps still (a frozen layer) is read in
place; a change to a tensor read in place before its copy finished fails the version
instead of committing a mix of two states."""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import pytest
import torch

from pcframe import Checkpointer, SaveError
from pcframe.errors import TornSnapshot
from pcframe.restore.reader import load_version
from pcframe.save.fill import Filler
from pcframe.store.directory import CheckpointDir

OPTIONS = {"chunk_bytes": 64 << 10, "max_in_flight": 1}


class Student(torch.nn.Module):
    """A trained net, an EMA teacher of it and a frozen embedding, as in BYOL or fine-tuning."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
        self.ema = copy.deepcopy(self.net).requires_grad_(False)
        self.frozen = torch.nn.Linear(64, 64).requires_grad_(False)


def _slow_copy(monkeypatch) -> None:
    """Each staged chunk takes 20 ms: the copy runs well past the next lines of the test."""
    fill = Filler.chunk

    def slow(self, *args, **kwargs):
        time.sleep(0.02)
        return fill(self, *args, **kwargs)

    monkeypatch.setattr(Filler, "chunk", slow)


@contextlib.contextmanager
def _copying_version_2(tmp_path, monkeypatch):
    """A checkpointer that committed version 1 and holds version 2's copy before its first
    chunk until the test sets the event it gets: ``(ckpt, model, version 2's handle, the
    event)``. (Slowed by 20 ms a chunk instead, the copy could be over before the test's
    change on a loaded machine, and the version committed.)"""
    torch.manual_seed(0)
    model = Student()
    optimizer = torch.optim.AdamW(model.net.parameters(), lr=1e-2)
    go = threading.Event()
    fill = Filler.chunk

    def held(self, *args, **kwargs):
        assert go.wait(30), "the test never let version 2's copy go on"
        return fill(self, *args, **kwargs)

    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **OPTIONS) as ckpt:
        _step(model, optimizer)
        ckpt.save(1).wait()
        monkeypatch.setattr(Filler, "chunk", held)
        try:
            yield ckpt, model, ckpt.save(2), go
        finally:
            go.set()  # a test that failed before it did: the engine closes


def _read_in_place(request) -> dict[str, int]:
    """Where each captured tensor's bytes are (the live tensor's, unless it was cloned)."""
    entries = request.layout.entries
    return {e.name: t.data_ptr() for e, t in zip(entries, request.tensors, strict=True)}


def _ema_update(model: Student) -> None:
    with torch.no_grad():
        for teacher, student in zip(model.ema.parameters(), model.net.parameters(), strict=True):
            teacher.mul_(0.5).add_(student, alpha=0.5)


def _step(model: Student, optimizer: torch.optim.Optimizer) -> None:
    model.net(model.frozen(torch.randn(4, 64))).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_an_ema_copy_updated_before_each_step_is_saved_as_it_was_at_save(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = Student()
    optimizer = torch.optim.AdamW(model.net.parameters(), lr=1e-2)
    _slow_copy(monkeypatch)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **OPTIONS) as ckpt:
        expected = {}
        for step in (1, 2, 3):
            _ema_update(model)  # the top of the iteration, before optimizer.step()
            _step(model, optimizer)
            handle = ckpt.save(step)
            expected[handle.version] = {
                k: v.clone() for k, v in model.state_dict().items() if k.startswith("ema.")
            }
            _ema_update(model)  # lands while the copy is still running
        ckpt.wait()
    for version, ema in expected.items():
        named = load_version(tmp_path / f"v{version:08d}").named_tensors()
        for key, value in ema.items():
            assert torch.equal(named[f"model/{key}"], value), (version, key)


def test_a_frozen_layer_is_read_in_place_not_cloned(tmp_path):
    torch.manual_seed(0)
    model = Student()
    optimizer = torch.optim.AdamW(model.net.parameters(), lr=1e-2)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **OPTIONS) as ckpt:
        _step(model, optimizer)
        for _ in range(2):
            request = ckpt._capture.request(99, 1, {})
            read = _read_in_place(request)
            assert read["model/frozen.weight"] == model.frozen.weight.data_ptr()
            assert read["model/net.0.weight"] == model.net[0].weight.data_ptr()  # stepped
            assert read["model/ema.0.weight"] == model.ema[0].weight.data_ptr()  # still so far
        _ema_update(model)
        request = ckpt._capture.request(99, 1, {})
        read = _read_in_place(request)
        assert read["model/ema.0.weight"] != model.ema[0].weight.data_ptr()  # moved: cloned


def test_a_stepped_parameter_changed_during_the_copy_fails_the_version(tmp_path, monkeypatch):
    """Weight clipping in place after save() and before the copy finished (not through the
    optimizer, which would wait): the version is failed with the tensor named, and the one
    before it stays the newest."""
    with _copying_version_2(tmp_path, monkeypatch) as (ckpt, model, handle, go):
        with torch.no_grad():
            model.net[1].weight.clamp_(-0.01, 0.01)
        go.set()
        with pytest.raises(SaveError, match=r"model/net\.1\.weight changed in place") as info:
            handle.wait()
        assert isinstance(info.value.cause, TornSnapshot)
        monkeypatch.undo()
        ckpt.wait_for_snapshot()
        assert ckpt.save(3).wait() == "committed"  # after wait_for_snapshot: fine
    assert CheckpointDir(tmp_path).committed_versions() == [1, 3]


def test_an_optimizer_stepping_a_parameter_the_model_lacks_is_refused(tmp_path):
    """A CLIP-style logit_scale given to the optimizer but not registered on the model was
    never saved: a restore put its Adam moments back beside its initial value, silently."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    scale = torch.nn.Parameter(torch.tensor(2.0))
    optimizer = torch.optim.AdamW([*model.parameters(), scale])
    with pytest.raises(ValueError, match=r"does not hold \(first: param group 0, position 2"):
        Checkpointer(tmp_path, model=model, optimizer=optimizer)
    # Added to the optimizer after the engine was built: the save refuses, nothing written.
    optimizer = torch.optim.AdamW(model.parameters())
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        optimizer.add_param_group({"params": [scale]})
        with pytest.raises(ValueError, match="register them on the model"):
            ckpt.save(1)
        model.scale = scale  # registered: saved and restored
        assert ckpt.save(2).wait() == "committed"
    assert CheckpointDir(tmp_path).committed_versions() == [1]


def test_an_ema_updated_every_few_steps_is_cloned_at_every_save(tmp_path, monkeypatch):
    """An EMA updated every third step (ema-pytorch's update_every, SWA per epoch) kept
    still between updates, was read in place again, and lost every third version to a
    torn copy: once it has moved, it is cloned at every save. (Its very first update, if
    it came during a copy, fails that one version: nothing showed it moves before.)"""
    torch.manual_seed(0)
    model = Student()
    optimizer = torch.optim.AdamW(model.net.parameters(), lr=1e-2)
    _slow_copy(monkeypatch)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **OPTIONS) as ckpt:
        expected = {}
        _step(model, optimizer)
        _ema_update(model)  # its first update, before any save
        for step in range(1, 8):
            _step(model, optimizer)
            handle = ckpt.save(step)
            expected[handle.version] = model.ema[0].weight.clone()
            if step % 3 == 0:
                _ema_update(model)  # while the copy runs
        ckpt.wait()
    assert CheckpointDir(tmp_path).committed_versions()[-3:] == [5, 6, 7]  # none failed
    for version in (5, 6, 7):
        named = load_version(tmp_path / f"v{version:08d}").named_tensors()
        assert torch.equal(named["model/ema.0.weight"], expected[version]), version


def _ema_update_through_data(model: Student) -> None:
    """The BYOL / MoCo / DINO form: through ``.data``, which moves no in-place counter."""
    for teacher, student in zip(model.ema.parameters(), model.net.parameters(), strict=True):
        teacher.data.mul_(0.5).add_(student.data, alpha=0.5)


def test_an_ema_updated_through_data_is_saved_as_it_was_at_save(tmp_path, monkeypatch):
    """No counter moves, but the values do: from the first save after the teacher moved,
    it is cloned. (A teacher that first moves during a copy fails that one version.)"""
    torch.manual_seed(0)
    model = Student()
    optimizer = torch.optim.AdamW(model.net.parameters(), lr=1e-2)
    _slow_copy(monkeypatch)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **OPTIONS) as ckpt:
        expected = {}
        for step in (1, 2, 3, 4):
            _step(model, optimizer)
            _ema_update_through_data(model)  # the student moved: so does the teacher
            handle = ckpt.save(step)
            expected[handle.version] = model.ema[0].weight.clone()
            _ema_update_through_data(model)  # lands while the copy is still running
        ckpt.wait()
    committed = CheckpointDir(tmp_path).committed_versions()
    assert committed == [2, 3, 4]  # none failed (keep_last=3)
    for version in committed:
        weight = expected[version]
        named = load_version(tmp_path / f"v{version:08d}").named_tensors()
        assert torch.equal(named["model/ema.0.weight"], weight), version


def test_a_still_parameter_changed_through_data_during_the_copy_fails_the_version(
    tmp_path, monkeypatch
):
    """The frozen layer is read in place; written through .data before its copy finished
    (no counter moves), the version is failed rather than committed with the new values."""
    with _copying_version_2(tmp_path, monkeypatch) as (_, model, handle, go):
        model.frozen.weight.data.mul_(2.0)
        go.set()
        with pytest.raises(SaveError, match=r"model/frozen\.weight changed in place"):
            handle.wait()
    assert CheckpointDir(tmp_path).committed_versions() == [1]
