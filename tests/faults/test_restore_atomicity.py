"""A restore that does not fit the objects changes nothing, and says every reason why.

Each case saves a complete job (model, Adam, StepLR, GradScaler, data position, extra),
then restores it into objects that differ in one way (or a manifest re-signed with damaged
state). The restore must raise one CheckpointError listing the mismatch, leave every byte
of every object as it was (model, optimizer state and param groups, scheduler, scaler,
data position, RNGs, extra), and leave the version committed (a mismatch is not corruption).
``strict=False`` and ``allow_cast=True`` load what they promise.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pcframe import Checkpointer, CheckpointError, ResumableLoader, ResumableSampler
from pcframe.errors import PolicyError, StateMismatch
from pcframe.policies import FixedSteps
from pcframe.policies.base import Restarted
from pcframe.state.rng import capture_rng, check_rng
from pcframe.store.directory import CheckpointDir
from tests.format.test_hostile_manifest import rewrite
from tests.helpers import CPU_AND_CUDA

SAVED_STEP = 3


class Counter:
    """A stateful object; a state with value ``refuse`` is half loaded and then refused."""

    def __init__(self, value: int = 0, refuse: int | None = None) -> None:
        self.value, self.refuse = value, refuse

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]
        if state["value"] == self.refuse:
            raise RuntimeError("counter refuses")


@dataclass
class Job:
    """One set of training objects; the defaults are the ones that were saved."""

    seed: int = 0
    out: int = 4
    dtype: torch.dtype = torch.float32
    norm_stats: bool = True
    extra_buffer: bool = False
    optimizer: str = "adam"
    scheduler: bool = True
    scaler: bool = True
    counters: dict[str, Counter] = field(default_factory=dict)
    extra: dict[str, Any] | None = field(default_factory=lambda: {"epoch": 0})
    steps: int = 1

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        self.model = nn.Sequential(
            nn.Linear(16, 32),
            nn.BatchNorm1d(32, track_running_stats=self.norm_stats),
            nn.ReLU(),
            nn.Linear(32, self.out),
        ).to(self.dtype)
        if self.extra_buffer:
            self.model.register_buffer("calibration", torch.zeros(3, dtype=self.dtype))
        params = list(self.model.parameters())
        if self.optimizer == "adam":
            self.opt = torch.optim.Adam(params, lr=1e-2)
        elif self.optimizer == "sgd":
            self.opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
        elif self.optimizer == "adam two groups":
            self.opt = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
        elif self.optimizer == "adam first layer":
            self.opt = torch.optim.Adam(params[:2], lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 2, 0.5) if self.scheduler else None
        self.grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if self.scaler else None
        sampler = ResumableSampler(40, seed=3)
        self.data = ResumableLoader(DataLoader(TensorDataset(torch.arange(40)), 4, sampler=sampler))
        generator = torch.Generator().manual_seed(self.seed + 1)
        batches = iter(self.data)
        for _ in range(self.steps):
            next(batches)
            inputs = torch.randn(8, 16, generator=generator).to(self.dtype)
            loss = self.model(inputs).float().pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            if self.sched is not None:
                self.sched.step()
        if self.extra is not None:
            self.extra["epoch"] = self.steps
        random.random(), np.random.rand(), torch.rand(1)  # each job leaves its own RNG states

    def checkpointer(self, directory) -> Checkpointer:
        return Checkpointer(
            directory,
            model=self.model,
            optimizer=self.opt,
            scheduler=self.sched,
            scaler=self.grad_scaler,
            data=self.data,
            stateful=self.counters or None,
            extra=self.extra,
        )

    def everything(self) -> Any:
        """Every byte a restore could change, in a comparable form."""
        return freeze(
            {
                "model": self.model.state_dict(),
                "parameters": dict(self.model.named_parameters()),
                "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict() if self.sched else None,
                "scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
                "data": self.data.state_dict(),
                "counters": {name: c.state_dict() for name, c in self.counters.items()},
                "extra": self.extra,
                "rng": {
                    "python": random.getstate(),
                    "numpy": np.random.get_state(legacy=False),
                    "torch": torch.get_rng_state(),
                },
            }
        )


def freeze(value: Any) -> Any:
    """Tensors and arrays as (dtype, shape, raw bytes); containers recursively, in order."""
    if isinstance(value, torch.Tensor):
        raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return ("tensor", str(value.dtype), tuple(value.shape), bytes(raw.numpy()))
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(freeze(v) for v in value))
    return repr(value)


@pytest.fixture
def saved(tmp_path):
    """Save a complete job (or one without some objects) and return its directory and job."""

    def save(**changes) -> tuple[Any, Job]:
        directory = tmp_path / "ckpt"
        job = Job(steps=SAVED_STEP, **changes)
        with job.checkpointer(directory) as ckpt:
            ckpt.save(step=SAVED_STEP).wait()
        return directory, job

    return save


def tree_of(body: dict) -> dict:
    return body["tree"]


def model_ref(body: dict) -> int:
    return tree_of(body)["model"]["0.weight"]["$t"]


def python_rng_short(body: dict) -> None:
    python = tree_of(body)["rng"]["python"]["$tuple"]
    python[1]["$tuple"] = python[1]["$tuple"][:100]


def numpy_pos_out_of_range(body: dict) -> None:
    tree_of(body)["rng"]["numpy"]["state"]["pos"] = 10**6


def torch_rng_is_weights(body: dict) -> None:
    tree_of(body)["rng"]["torch"] = {"$t": model_ref(body)}


# case: (saved without, live changes, manifest mutation, what the error must say)
CASES: dict[str, tuple[dict, dict, Any, list[str]]] = {
    "missing key": (
        {},
        {"extra_buffer": True},
        None,
        [r"keys the checkpoint lacks: \['calibration'\]"],
    ),
    "extra key": (
        {},
        {"norm_stats": False},
        None,
        [r"keys the model lacks: \['1.running_mean', '1.running_var', '1.num_batches_tracked'\]"],
    ),
    "other shape": (
        {},
        {"out": 5},
        None,
        [
            r"model\['3.weight'\]: shape \(4, 32\) in the checkpoint, \(5, 32\) here",
            r"optimizer state of parameter 4: \['exp_avg'\]: shape \(4, 32\)",
        ],
    ),
    "other dtype": (
        {},
        {"dtype": torch.bfloat16},
        None,
        [r"model\['0.weight'\]: dtype torch.float32 in the checkpoint, torch.bfloat16"],
    ),
    "adam into sgd": (
        {},
        {"optimizer": "sgd"},
        None,
        [
            r"param group 0: lacks hyperparameters \['dampening', 'momentum'\] that SGD reads",
            r"lacks \['momentum_buffer'\]",
        ],
    ),
    "adam into a fresh sgd": (
        {},
        {"optimizer": "sgd", "steps": 0},
        None,
        [r"lacks \['momentum_buffer'\], which a step of SGD has"],
    ),
    "recorded optimizer class": (
        {},
        {},
        lambda b: tree_of(b).update(optimizer_class="torch.optim.sgd.SGD"),
        [r"saved from a torch.optim.sgd.SGD, this optimizer is a torch.optim.adam.Adam"],
    ),
    "param group count": (
        {},
        {"optimizer": "adam two groups"},
        None,
        [r"1 param groups in the checkpoint, 2 here"],
    ),
    "param group size": ({}, {"optimizer": "adam first layer"}, None, [r"group 0: 6 vs 2"]),
    "scheduler the checkpoint lacks": (
        {"scheduler": False},
        {},
        None,
        ["scheduler: the checkpoint holds no scheduler state, but the Checkpointer was given one"],
    ),
    "scaler the checkpoint lacks": (
        {"scaler": False},
        {},
        None,
        ["scaler: the checkpoint holds no scaler state"],
    ),
    "missing stateful name": (
        {},
        {"counters": {"counter": Counter(5)}},
        None,
        [r"stateful\['counter'\]: the checkpoint has no stateful object named 'counter'"],
    ),
    "python rng too short": (
        {},
        {},
        python_rng_short,
        [r"rng\['python'\]: refused by random.setstate"],
    ),
    "numpy rng position": (
        {},
        {},
        numpy_pos_out_of_range,
        [r"rng\['numpy'\]: 'pos' 1000000 is not"],
    ),
    "torch rng of another dtype": (
        {},
        {},
        torch_rng_is_weights,
        [r"rng\['torch'\]: must be a 1-d uint8 tensor"],
    ),
    "extra the checkpoint lacks": (
        {"extra": None},
        {},
        None,
        ["extra: the checkpoint holds no extra state"],
    ),
    "extra not a dict": (
        {},
        {},
        lambda b: tree_of(b).update(extra=[1, 2]),
        ["extra: the checkpoint holds a list"],
    ),
}


def committed_untouched(directory) -> None:
    assert CheckpointDir(directory).committed_versions() == [1]
    assert not [p for p in directory.iterdir() if p.name.startswith(".corrupt-")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_mismatch_changes_nothing_and_is_listed(saved, case):
    without, changes, mutate, messages = CASES[case]
    directory, _ = saved(**{name: value for name, value in without.items()})
    if mutate is not None:
        rewrite(directory / "v00000001", mutate)
    live = Job(seed=7, **changes)
    before = live.everything()
    with live.checkpointer(directory) as ckpt:
        with pytest.raises(StateMismatch, match="does not fit the objects given") as caught:
            ckpt.restore()
        assert live.everything() == before, f"{case}: a failed restore changed the objects"
    for message in messages:
        assert any(re.search(message, m) for m in caught.value.mismatches), (
            f"{case}: {message!r} not in {caught.value.mismatches}"
        )
        assert re.search(message, str(caught.value))
    assert isinstance(caught.value, CheckpointError)
    committed_untouched(directory)


def test_every_mismatch_is_listed_in_one_error(saved):
    directory, _ = saved(scheduler=False)
    rewrite(directory / "v00000001", numpy_pos_out_of_range)
    live = Job(seed=7, dtype=torch.float64, counters={"counter": Counter(1)})
    before = live.everything()
    with live.checkpointer(directory) as ckpt, pytest.raises(StateMismatch) as caught:
        ckpt.restore()
    assert live.everything() == before
    text = str(caught.value)
    for needle in (
        "stateful['counter']",
        "scheduler: the checkpoint holds no",
        "model['0.weight']: dtype",
        "optimizer state of parameters",
        "rng['numpy']",
    ):
        assert needle in text, needle
    assert text.count("\n  - ") == len(caught.value.mismatches) >= 5


def test_after_a_mismatch_the_same_version_still_restores(saved):
    directory, job = saved()
    with Job(seed=7, out=5).checkpointer(directory) as ckpt, pytest.raises(StateMismatch):
        ckpt.restore()
    live = Job(seed=7)
    with live.checkpointer(directory) as ckpt:
        assert ckpt.restore() == SAVED_STEP
        assert ckpt.last_restore.skipped == [] and ckpt.last_restore.not_loaded == []
    assert freeze(live.model.state_dict()) == freeze(job.model.state_dict())
    assert freeze(live.opt.state_dict()) == freeze(job.opt.state_dict())


def test_a_recorded_optimizer_class_that_matches_loads(saved):
    directory, job = saved()
    rewrite(
        directory / "v00000001",
        lambda b: tree_of(b).update(optimizer_class="torch.optim.adam.Adam"),
    )
    live = Job(seed=7)
    with live.checkpointer(directory) as ckpt:
        assert ckpt.restore() == SAVED_STEP
    assert freeze(live.opt.state_dict()) == freeze(job.opt.state_dict())


# --- checks pass, load_state_dict fails anyway: everything is rolled back --------------------


def _raise(*_args):
    raise RuntimeError("injected load failure")


ROLLBACKS = {
    # the model loads last of the fallible objects: data, scheduler, scaler, optimizer are
    # already loaded when its post hook raises
    "model": lambda job: job.model.register_load_state_dict_post_hook(_raise),
    "optimizer": lambda job: job.opt.register_load_state_dict_post_hook(_raise),
    "stateful": lambda job: job.counters.update(zz=Counter(9, refuse=4)),
}


@pytest.mark.parametrize("where", sorted(ROLLBACKS))
def test_a_failing_load_rolls_every_object_back(saved, where):
    directory, _ = saved(counters={"zz": Counter(4)})
    live = Job(seed=7, counters={"zz": Counter(9)})
    ROLLBACKS[where](live)
    before = live.everything()
    with live.checkpointer(directory) as ckpt:
        with pytest.raises(CheckpointError, match="rolled back, nothing was loaded") as caught:
            ckpt.restore()
        assert not isinstance(caught.value, StateMismatch)
        assert "injected load failure" in str(caught.value) or "counter refuses" in str(
            caught.value
        )
        assert live.everything() == before
    committed_untouched(directory)


class Aliased(nn.Module):
    """A parameter and a persistent buffer that is a transposed view of its memory."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((3, 4), value))
        self.register_buffer("w_t", self.w.detach().t())


def test_a_rollback_undoes_what_an_alias_wrote_into_a_parameter_read_in_place(tmp_path):
    """The parameter is read in place (no undo copy needed for it); its transposed alias is
    loaded from a fresh tensor and writes into the same memory. The undo skipped both, by
    start address, so a failed restore left the parameter holding the checkpoint's values."""
    saved = Aliased(1.0)
    saved.register_buffer("z", torch.ones(2))
    with Checkpointer(tmp_path, model=saved) as ckpt:
        ckpt.save(step=1).wait()
    live = Aliased(7.0)
    with torch.inference_mode():  # load_state_dict's copy_ into it fails (no hook: a hook
        live.register_buffer("z", torch.zeros(2))  # would turn reading in place off)
    with (
        Checkpointer(tmp_path, model=live) as ckpt,
        pytest.raises(CheckpointError, match="rolled back, nothing was loaded"),
    ):
        ckpt.restore()
    assert torch.equal(live.w.detach(), torch.full((3, 4), 7.0))
    fine = Aliased(0.0)
    fine.register_buffer("z", torch.zeros(2))
    with Checkpointer(tmp_path, model=fine) as ckpt:
        assert ckpt.restore() == 1
    assert torch.equal(fine.w.detach(), torch.full((3, 4), 1.0))
    assert fine.w_t.data_ptr() == fine.w.data_ptr()  # still one memory


class Tagged(nn.Module):
    """A layer with extra state (a tag, as a vocabulary or a quantization recipe would be)
    that ``checks`` refuses to replace with another one."""

    def __init__(self, tag: str, checks: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.tag, self.checks = tag, checks

    def get_extra_state(self) -> dict[str, str]:
        return {"tag": self.tag}

    def set_extra_state(self, state: dict[str, str]) -> None:
        if self.checks and state["tag"] != self.tag:
            raise ValueError(f"tag {state['tag']!r} is not {self.tag!r}")
        self.tag = state["tag"]


@pytest.mark.parametrize("strict", [True, False])
def test_a_model_failing_half_way_puts_back_the_extra_state_it_had_set(tmp_path, strict):
    """torch's load_state_dict sets each module's extra state in turn: the second module's
    set_extra_state refusing left the first holding the checkpoint's, while the error said
    every object was rolled back (the undo put back parameters and buffers only)."""
    with Checkpointer(tmp_path, model=nn.Sequential(Tagged("a1"), Tagged("b1"))) as ckpt:
        ckpt.save(step=1).wait()
    live = nn.Sequential(Tagged("a2"), Tagged("b2", checks=True))
    before = freeze(live.state_dict())
    with Checkpointer(tmp_path, model=live) as ckpt:
        if strict:
            with pytest.raises(CheckpointError, match="rolled back, nothing was loaded"):
                ckpt.restore()
        else:
            assert ckpt.restore(strict=False) == 1
            assert ckpt.last_restore.not_loaded[0].startswith("model: load_state_dict failed")
    assert (live[0].tag, live[1].tag) == ("a2", "b2")
    assert freeze(live.state_dict()) == before
    committed_untouched(tmp_path)


class BrokenOnRestart(FixedSteps):
    """A plugin policy whose observe() fails on the restart event."""

    def observe(self, event: object) -> None:
        if isinstance(event, Restarted):
            raise KeyError("no such zone")
        super().observe(event)


def test_a_policy_failing_when_told_of_the_restore_does_not_make_it_look_failed(tmp_path):
    """The policy is told of the restart once the restored state holds. Its error used to
    leave restore() there, so a restore that raised had changed every object; now the
    restore returns and the policy's error, naming it, is raised at the next engine call."""
    torch.manual_seed(0)
    saved = nn.Linear(3, 2)
    with Checkpointer(tmp_path, model=saved, policy=FixedSteps(5)) as ckpt:
        ckpt.save(step=1).wait()
    live = nn.Linear(3, 2)
    with Checkpointer(tmp_path, model=live, policy=BrokenOnRestart(5)) as ckpt:
        assert ckpt.restore() == 1
        assert freeze(live.state_dict()) == freeze(saved.state_dict())
        with pytest.raises(
            PolicyError, match=r"BrokenOnRestart\.observe raised KeyError.*restore holds"
        ):
            ckpt.maybe_save(2)
        ckpt.maybe_save(3)  # raised once


def test_strict_false_leaves_out_a_failing_object_and_loads_the_rest(saved):
    directory, job = saved(counters={"zz": Counter(4)})
    live = Job(seed=7, counters={"zz": Counter(9, refuse=4)})
    with live.checkpointer(directory) as ckpt:
        assert ckpt.restore(strict=False) == SAVED_STEP
        assert ckpt.last_restore.not_loaded == [
            "stateful['zz']: load_state_dict failed: RuntimeError: counter refuses"
        ]
    assert live.counters["zz"].value == 9  # its half-done load was undone
    assert freeze(live.model.state_dict()) == freeze(job.model.state_dict())
    assert freeze(live.data.state_dict()) == freeze(job.data.state_dict())


# --- what strict=False and allow_cast=True load ----------------------------------------------


def test_strict_false_loads_the_matching_keys_and_reports_the_rest(saved):
    directory, job = saved(scheduler=False)
    live = Job(seed=7, out=5, extra_buffer=True, counters={"counter": Counter(5)})
    kept_head = live.model[3].weight.detach().clone()
    kept_optimizer = freeze(live.opt.state_dict())
    kept_scheduler = freeze(live.sched.state_dict())
    with live.checkpointer(directory) as ckpt:
        assert ckpt.restore(strict=False) == SAVED_STEP
        not_loaded = ckpt.last_restore.not_loaded
    saved_model = job.model.state_dict()
    live_model = live.model.state_dict()
    for key in ("0.weight", "0.bias", "1.weight", "1.running_mean", "1.num_batches_tracked"):
        assert freeze(live_model[key]) == freeze(saved_model[key]), key
    assert torch.equal(live.model[3].weight, kept_head)  # another shape: left as it was
    assert freeze(live.opt.state_dict()) == kept_optimizer  # its state does not fit: left out
    assert freeze(live.sched.state_dict()) == kept_scheduler  # none saved: left alone
    assert live.counters["counter"].value == 5
    assert freeze(live.data.state_dict()) == freeze(job.data.state_dict())
    assert live.extra == job.extra
    assert torch.equal(torch.get_rng_state(), _saved_rng(directory)["torch"])
    for needle in (
        "model['3.weight']: shape",
        "keys the checkpoint lacks: ['calibration']",
        "optimizer state of parameter 4",
        "scheduler: the checkpoint holds no",
        "stateful['counter']",
    ):
        assert any(needle in line for line in not_loaded), (needle, not_loaded)


def test_strict_false_skips_only_a_damaged_generator(saved):
    directory, _ = saved()
    rewrite(directory / "v00000001", numpy_pos_out_of_range)
    live = Job(seed=7)
    numpy_before = freeze(np.random.get_state(legacy=False))
    with live.checkpointer(directory) as ckpt:
        assert ckpt.restore(strict=False) == SAVED_STEP
        assert [line.split(":")[0] for line in ckpt.last_restore.not_loaded] == ["rng['numpy']"]
    assert freeze(np.random.get_state(legacy=False)) == numpy_before
    saved_rng = _saved_rng(directory)
    assert torch.equal(torch.get_rng_state(), saved_rng["torch"])
    assert random.getstate() == saved_rng["python"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_allow_cast_loads_cast_values(saved, dtype):
    directory, job = saved()
    live = Job(seed=7, dtype=dtype)
    with live.checkpointer(directory) as ckpt:
        with pytest.raises(StateMismatch, match="allow_cast=True"):
            ckpt.restore()
        assert ckpt.restore(allow_cast=True) == SAVED_STEP
        assert ckpt.last_restore.not_loaded == []
    for key, value in job.model.state_dict().items():
        restored = live.model.state_dict()[key]
        assert restored.dtype == (dtype if value.is_floating_point() else value.dtype), key
        assert torch.equal(restored, value.to(restored.dtype)), key
    saved_moments = job.opt.state_dict()["state"][0]["exp_avg"]
    restored_moments = live.opt.state_dict()["state"][0]["exp_avg"]
    assert restored_moments.dtype == dtype and torch.equal(
        restored_moments, saved_moments.to(dtype)
    )


def _saved_rng(directory) -> dict[str, Any]:
    from pcframe.restore.reader import load_version

    return load_version(directory / "v00000001").state_tree()["rng"]


# --- the RNG check on its own ----------------------------------------------------------------


def test_check_rng_accepts_captured_states_and_names_each_damaged_one():
    state = capture_rng()
    assert check_rng(state) == {}
    python_version, internal, _ = state["python"]
    damaged = {
        "python": (python_version, internal, "not a float"),
        "numpy": {**state["numpy"], "state": {"key": np.zeros(5, np.uint32), "pos": 0}},
        "torch": state["torch"].reshape(2, -1),
        "cuda": "none",
    }
    problems = check_rng(damaged)
    assert sorted(problems) == ["cuda", "numpy", "python", "torch"]
    assert "gauss" in problems["python"] and "(624,)" in problems["numpy"]
    assert "1-d uint8" in problems["torch"] and "list" in problems["cuda"]
    assert check_rng([1, 2]) == {"rng": "is a list, not a dict of generator states"}
    assert check_rng({"torch": torch.zeros(5056, dtype=torch.uint8)})["torch"].startswith("refused")


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_checks_and_rollback_on_the_device(tmp_path, device):
    """Device tensors: the scratch optimizer step, the host snapshot, the CUDA RNG check."""

    def build(seed: int, optimizer=torch.optim.Adam):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(device)
        opt = optimizer(model.parameters(), lr=1e-2)
        model(torch.randn(4, 8, device=device)).sum().backward()
        opt.step()
        return model, opt

    def state(model, opt):
        rng = torch.cuda.get_rng_state_all() if device == "cuda" else []
        return freeze({"model": model.state_dict(), "opt": opt.state_dict(), "cuda": rng})

    saved_model, saved_opt = build(0)
    with Checkpointer(tmp_path, model=saved_model, optimizer=saved_opt) as ckpt:
        ckpt.save(step=1).wait()
    model, opt = build(1, lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.5))
    before = state(model, opt)
    with (
        Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt,
        pytest.raises(StateMismatch, match=r"lacks \['momentum_buffer'\]"),
    ):
        ckpt.restore()
    assert state(model, opt) == before
    model, opt = build(1)
    model.register_load_state_dict_post_hook(_raise)
    before = state(model, opt)
    with (
        Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt,
        pytest.raises(CheckpointError, match="rolled back"),
    ):
        ckpt.restore()
    assert state(model, opt) == before
    if device == "cuda":
        rewrite(
            tmp_path / "v00000001",
            lambda b: tree_of(b)["rng"].update(cuda=[{"$t": model_ref(b)}]),
        )
        model, opt = build(1)
        before = state(model, opt)
        with (
            Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt,
            pytest.raises(StateMismatch, match=r"rng\['cuda'\]: device 0: must be a 1-d uint8"),
        ):
            ckpt.restore()
        assert state(model, opt) == before


OPTIMIZERS = {
    "SGD": {"momentum": 0.9, "nesterov": True},
    "Adam": {"amsgrad": True},
    "AdamW": {},
    "Adagrad": {},
    "Adadelta": {},
    "Adamax": {},
    "ASGD": {},
    "NAdam": {},
    "RAdam": {},
    "RMSprop": {"momentum": 0.5, "centered": True},
    "Rprop": {},
    "LBFGS": {},
    "Adafactor": {},
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_torch_optimizer_restores_its_own_state(tmp_path, name):
    """No false alarms: each class's state (trained or fresh target) passes the checks."""
    cls = getattr(torch.optim, name, None)
    if cls is None:
        pytest.skip(f"torch.optim.{name} is not in this torch")

    def build(seed: int, steps: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        opt = cls(model.parameters(), lr=0.01, **OPTIMIZERS[name])

        def closure():
            opt.zero_grad()
            loss = model(torch.randn(4, 6)).pow(2).mean()
            loss.backward()
            return loss

        for _ in range(steps):
            opt.step(closure)
        return model, opt

    model, opt = build(0, 3)
    with Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        ckpt.save(step=3).wait()
    for steps in (2, 0):  # into an optimizer with state, and into a fresh one
        live_model, live_opt = build(1, steps)
        with Checkpointer(tmp_path, model=live_model, optimizer=live_opt) as ckpt:
            assert ckpt.restore() == 3
        assert freeze(live_opt.state_dict()) == freeze(opt.state_dict())
    wrong = torch.optim.SGD if name != "SGD" else torch.optim.Adam
    live_model, _ = build(1, 0)
    with (
        Checkpointer(tmp_path, model=live_model, optimizer=wrong(live_model.parameters())) as ckpt,
        pytest.raises(StateMismatch, match="optimizer"),
    ):
        ckpt.restore()
