"""The scratch step that finds an optimizer's fresh state runs while the checkpoint is read,
and its result is used only for the hyperparameters it was found with."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
from torch import nn

from pcframe import Checkpointer
from pcframe.restore import restorer
from pcframe.state import optimizer as check_optimizer


def _trained(amsgrad: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=amsgrad)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step()
    return model, opt


def _fresh(amsgrad: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    return model, torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=amsgrad)


@pytest.mark.parametrize("decayed", [False, True], ids=["same lr", "lr decayed by a schedule"])
def test_the_scratch_step_runs_once_beside_the_read(tmp_path, monkeypatch, decayed):
    model, opt = _trained(amsgrad=False)
    if decayed:  # as a schedule leaves them: saved lr 0.005 and initial_lr; live lr 0.01
        for group in opt.param_groups:
            group["initial_lr"], group["lr"] = group["lr"], group["lr"] / 2
    with Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        ckpt.save(step=1).wait()
    steps: list[str] = []
    real = check_optimizer._scratch_step

    def counted(*args):
        steps.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(check_optimizer, "_scratch_step", counted)
    monkeypatch.setattr(check_optimizer, "_FOUND", {})
    live_model, live_opt = _fresh(amsgrad=False)
    with Checkpointer(tmp_path, model=live_model, optimizer=live_opt) as ckpt:
        assert ckpt.restore() == 1
    # found once, on the prefetching thread; the check used that result
    assert steps == ["pcframe-fresh-state"]
    assert torch.equal(
        live_opt.state_dict()["state"][0]["exp_avg"],
        opt.state[opt.param_groups[0]["params"][0]]["exp_avg"],
    )


def test_saved_hyperparameters_that_differ_are_checked_with_their_own_step(tmp_path):
    # Prefetched with the live amsgrad=True (whose step makes max_exp_avg_sq); the version was
    # saved with amsgrad=False, which the optimizer runs with after the load: no such key.
    model, opt = _trained(amsgrad=False)
    with Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        ckpt.save(step=1).wait()
    live_model, live_opt = _fresh(amsgrad=True)
    with Checkpointer(tmp_path, model=live_model, optimizer=live_opt) as ckpt:
        assert ckpt.restore() == 1
    assert live_opt.param_groups[0]["amsgrad"] is False
    assert "max_exp_avg_sq" not in live_opt.state_dict()["state"][0]


def test_the_prefetch_leaves_the_warning_filters_alone(tmp_path, monkeypatch):
    # Warning filters are process-wide: a scratch step that silenced warnings on its thread
    # would drop the main thread's while the read runs.
    model, opt = _trained(amsgrad=False)
    with Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        ckpt.save(step=1).wait()
    real_step, real_load = torch.optim.Adam.step, restorer.load_first_valid

    def slow_step(self, *args, **kwargs):
        time.sleep(0.4)  # the scratch step is still running while the read warns
        return real_step(self, *args, **kwargs)

    def warning_load(*args, **kwargs):
        time.sleep(0.1)
        warnings.warn("from the read", UserWarning, stacklevel=1)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", slow_step)
    monkeypatch.setattr(restorer, "load_first_valid", warning_load)
    monkeypatch.setattr(check_optimizer, "_FOUND", {})
    live_model, live_opt = _fresh(amsgrad=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Checkpointer(tmp_path, model=live_model, optimizer=live_opt) as ckpt:
            assert ckpt.restore() == 1
    assert any("from the read" in str(w.message) for w in seen)
