"""PcframeCallback's resume is all or nothing, any exit of ``train()`` releases its
directory, and a failed version stops training saying so (issue 40: 3b, 4, 6).

A real ``transformers.Trainer`` in this process: a tiny GPT-2 from a config on CPU, 16
samples in batches of 4 (4 steps an epoch). A version of step 6 is mid-epoch (2 steps into
epoch 1); each case resumes it where one part does not fit and checks that nothing the
Trainer had (weights, optimizer, scheduler, TrainerState, data position, RNG) changed.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import shutil
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import pcframe.save.persist as persist
from pcframe import Checkpointer
from pcframe.errors import CheckpointError, PolicyError, SaveError, StateMismatch
from pcframe.integrations._hf_state import refuse_other_schedule, schedule_of
from pcframe.integrations.transformers import PcframeCallback
from pcframe.state.rng import capture_rng
from tests.helpers import DiskFull
from tests.integrations import bad_policies
from tests.integrations.killing import tree_differences

# transformers' advice for a tiny CPU run (pin_memory, tokens) is not under test here.
pytestmark = pytest.mark.filterwarnings("ignore::Warning")

SAVED_STEP = 6  # 2 steps into epoch 1


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, length: int = 12, vocab: int = 32) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Refusing(GPT2LMHeadModel):
    """Its weights fail to load: the engine refuses the version after the TrainerState and
    the data position were applied."""

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("these weights are refused")


def trainer_for(
    directory: Path,
    steps: int,
    samples: int = 16,
    model_class: type = GPT2LMHeadModel,
    trainer_class: type = Trainer,
    callbacks: tuple[Any, ...] = (),
    add_later: bool = False,
    options: dict[str, Any] | None = None,
    quiet: bool = True,
    **arguments: Any,
) -> tuple[Trainer, PcframeCallback]:
    if quiet:
        transformers.logging.set_verbosity_error()
    else:  # as a default setup has it: the callback's warnings show
        transformers.logging.set_verbosity_warning()
    transformers.set_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = model_class(config)
    args = TrainingArguments(
        **{
            "output_dir": str(directory.parent / "hf-out"),
            "max_steps": steps,
            "per_device_train_batch_size": 4,
            "learning_rate": 5e-3,
            "seed": 0,
            "use_cpu": True,
            "report_to": [],
            "save_strategy": "no",
            "logging_strategy": "no",
            "eval_strategy": "no",
            "disable_tqdm": True,
            "dataloader_num_workers": 0,
            **arguments,
        }
    )
    callback = PcframeCallback(
        directory, **{"save_steps": 3, "max_in_flight": 1, **(options or {})}
    )
    given = [*callbacks] if add_later else [*callbacks, callback]
    trainer = trainer_class(model=model, args=args, train_dataset=Tokens(samples), callbacks=given)
    if add_later:  # after the constructor: the callback gets no on_init_end
        trainer.add_callback(callback)
    return trainer, callback


class Probe(transformers.TrainerCallback):
    """The Trainer's objects as train() begins (this callback runs before PcframeCallback),
    and a snapshot of them on demand."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.objects = {"state": state, **kwargs}
        self.before = self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        o = self.objects
        loader = o["train_dataloader"]
        batches = loader.batch_sampler  # accelerate's BatchSamplerShard around it, or not
        sampler = getattr(batches, "batch_sampler", batches).sampler
        return plain(
            copy.deepcopy(
                {
                    "weights": o["model"].state_dict(),
                    "optimizer": o["optimizer"].state_dict(),
                    "scheduler": o["lr_scheduler"].state_dict(),
                    "trainer_state": dataclasses.asdict(o["state"]),
                    "sampler_seed": sampler.initial_seed,
                    "skip_batches": loader.skip_batches,
                    "rng": capture_rng(),
                }
            )
        )


def plain(value: Any) -> Any:
    """numpy's RNG state holds an array: as a list, which tree_differences compares."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory whose newest version is step 6, mid-epoch."""
    directory = tmp_path_factory.mktemp("hf") / "ckpts"
    trainer, _ = trainer_for(directory, SAVED_STEP)
    trainer.train()
    return directory


@pytest.fixture
def ckpts(saved: Path, tmp_path: Path) -> Path:
    copied = tmp_path / "ckpts"
    shutil.copytree(saved, copied)
    return copied


def lock_is_free(directory: Path) -> bool:
    Checkpointer(directory).close()  # DirectoryLocked if a Checkpointer still holds it
    return True


# Each: what the refusing Trainer gets instead, and the words of the refusal.
REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "shorter dataset": ({"samples": 12}, "samples 16 -> 12"),
    "data seed": ({"seed": 1}, "seed 0 -> 1"),
    "batch size": ({"per_device_train_batch_size": 2}, "batches 4 -> 8"),
    "accumulation": ({"gradient_accumulation_steps": 2}, "accumulate 1 -> 2"),
    "model weights": ({"model_class": Refusing}, "these weights are refused"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_part_of_the_resume_changes_nothing(ckpts: Path, case: str) -> None:
    given, words = REFUSALS[case]
    probe = Probe()
    trainer, callback = trainer_for(ckpts, 20, callbacks=(probe,), **given)
    with pytest.raises(CheckpointError, match=words) as refused:
        trainer.train()
    assert "rolled back, nothing was loaded" in str(refused.value)
    if case != "model weights":
        assert "mid-epoch" in str(refused.value) and "resume=False" in str(refused.value)
    assert_nothing_changed(ckpts, probe, callback)


def assert_nothing_changed(ckpts: Path, probe: Any, callback: Any) -> None:
    """A refused resume changed nothing: not the Trainer's objects (``probe``), not the
    directory (released, and the Trainer of the saved run resumes it)."""
    assert probe.before["trainer_state"]["global_step"] == 0
    assert not tree_differences(probe.before, probe.snapshot())
    assert callback.checkpointer is None and lock_is_free(ckpts)
    trainer, callback = trainer_for(ckpts, 8)
    trainer.train()
    assert callback.resumed_step == SAVED_STEP and trainer.state.global_step == 8


# Each: the TrainingArguments of the resuming Trainer, and the mismatch its refusal names.
SCHEDULES: dict[str, tuple[dict[str, Any], str]] = {
    "type": (
        {"lr_scheduler_type": "cosine"},
        "scheduler: saved with TrainingArguments lr_scheduler_type='linear', this run has 'cosine'",
    ),
    "warmup": (
        {"warmup_steps": 2},
        "scheduler: saved with TrainingArguments warmup_steps=0, this run has 2",
    ),
    "kwargs": (
        {"lr_scheduler_type": "linear", "lr_scheduler_kwargs": {"last_epoch": -1}},
        "scheduler: saved with TrainingArguments lr_scheduler_kwargs={}, this run has "
        "{'last_epoch': -1}",
    ),
}


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_another_lr_schedule_is_refused_and_changes_nothing(ckpts: Path, case: str) -> None:
    """The run was saved with the default linear schedule, no warm-up. The Trainer builds a
    LambdaLR for every ``lr_scheduler_type``, so the engine's class check passed: a resume with
    "cosine" (another warm-up, other scheduler options) loaded the linear run's step counter
    and last LR into the cosine LambdaLR and trained on with another schedule, silently. Now
    it is refused as another LR scheduler is: one StateMismatch line naming the folder, the
    setting saved and this run's, and the fix; nothing the Trainer had changed."""
    given, mismatch = SCHEDULES[case]
    probe = Probe()
    trainer, callback = trainer_for(ckpts, 20, callbacks=(probe,), **given)
    with pytest.raises(StateMismatch) as refused:
        trainer.train()
    message = str(refused.value)
    assert message == (
        f"PcframeCallback: {ckpts} holds checkpoints of another LR scheduler ({mismatch}): "
        "configure the LR scheduler the run was saved with, give this run its own "
        f"output_dir, or pass resume=False to start over in {ckpts}"
    ), message
    assert refused.value.mismatches == [mismatch]
    assert_nothing_changed(ckpts, probe, callback)


def test_a_schedule_is_compared_only_where_both_runs_recorded_the_trainers_own(
    tmp_path: Path,
) -> None:
    """No refusal where there is nothing to compare: a version saved before the schedule was
    recorded, or a scheduler of the user's (``optimizers=``), which the arguments do not
    make (the Trainer says so: ``_created_lr_scheduler`` is False)."""
    args = TrainingArguments(
        output_dir=str(tmp_path), lr_scheduler_type="cosine", use_cpu=True, report_to=[]
    )
    assert schedule_of(args, types.SimpleNamespace(_created_lr_scheduler=False)) is None
    built = schedule_of(args, None)
    assert built is not None and built["lr_scheduler_type"] == "cosine"
    linear = {**built, "lr_scheduler_type": "linear"}
    refuse_other_schedule(None, built)  # saved before: no record
    refuse_other_schedule(linear, None)  # this run's scheduler is the user's own
    refuse_other_schedule(dict(built), built)
    with pytest.raises(StateMismatch, match="lr_scheduler_type='linear', this run has 'cosine'"):
        refuse_other_schedule(linear, built)


def test_other_data_after_a_version_at_an_epoch_end_is_used_from_the_next_epoch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "ckpts"
    trainer, _ = trainer_for(directory, 4)  # the end of epoch 0
    trainer.train()
    trainer, callback = trainer_for(directory, 8, samples=24)  # 6 steps an epoch now
    transformers.logging.set_verbosity_warning()  # the callback warns on transformers' logging
    root = logging.getLogger("transformers")  # which does not propagate to caplog's
    root.addHandler(caplog.handler)
    try:
        trainer.train()
    finally:
        root.removeHandler(caplog.handler)
    assert callback.resumed_step == 4 and trainer.state.global_step == 8
    assert trainer.state.epoch == pytest.approx(1 + 4 / 6)  # 4 steps into the true epoch 1
    assert "samples 16 -> 24" in caplog.text


class RaiseInStep:
    """A forward pre-hook that raises ``exc`` in the training step of step ``at``."""

    def __init__(self, at: int, exc: type[BaseException]) -> None:
        self.at, self.exc, self.calls = at, exc, 0

    def __call__(self, *args: Any) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise self.exc("raised inside a training step")


@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("attached", ["constructor", "add_callback"])
def test_any_exit_of_train_releases_the_directory(
    tmp_path: Path, raised: type[BaseException], attached: str
) -> None:
    directory = tmp_path / "ckpts"
    trainer, callback = trainer_for(directory, 8, add_later=attached == "add_callback")
    hook = trainer.model.register_forward_pre_hook(RaiseInStep(5, raised))
    with pytest.raises(raised):
        trainer.train()
    hook.remove()
    if attached == "constructor":  # train() was wrapped: closed as the exception left it
        assert callback.checkpointer is None and lock_is_free(directory)
        trainer.train()  # the same Trainer again, as a notebook cell run once more
        assert callback.resumed_step == 3 and trainer.state.global_step == 8
        del trainer.train  # the wrapper is the instance's: removing it leaves the class's
        assert trainer.train.__func__ is Trainer.train
    # Added later, it closes at the next train() of this process on the directory, here
    # a new Trainer's (the cell that builds the Trainer run again).
    trainer, callback = trainer_for(directory, 8, add_later=attached == "add_callback")
    trainer.train()
    assert callback.resumed_step in (3, 6, 8) and trainer.state.global_step == 8
    assert lock_is_free(directory)


class FillDisk(transformers.TrainerCallback):
    """Runs before PcframeCallback: the disk fills before the version of ``at`` is written;
    a step later the writer has failed it."""

    def __init__(self, disk: DiskFull, at: int) -> None:
        self.disk, self.at = disk, at
        self.callback: PcframeCallback | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            assert self.callback is not None and self.callback.checkpointer is not None
            self.callback.checkpointer.wait()  # the versions before are committed (a busy host)
            self.disk.full = True
        elif state.global_step == self.at + 1:
            assert self.disk.refused.wait(60)
            time.sleep(0.2)  # the failed version is handed over to the training thread


@pytest.mark.parametrize(("steps", "said"), [
    (40, r"PcframeCallback stopped training at step (\d+): "),
    (6, r"PcframeCallback: training ended at step (\d+), but "),
])  # fmt: skip
def test_a_failed_version_is_reported_as_what_the_callback_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int, said: str
) -> None:
    disk = DiskFull()
    monkeypatch.setattr(persist, "os", disk)
    directory = tmp_path / "ckpts"
    fill = FillDisk(disk, 6)
    trainer, callback = trainer_for(directory, steps, callbacks=(fill,))
    fill.callback = callback
    with pytest.raises(SaveError) as failed:
        trainer.train()
    message = str(failed.value)
    told = re.match(said, message)
    assert told is not None, message
    assert int(told[1]) == trainer.state.global_step >= 6  # it did stop (or end) there
    assert "no space left on device" in message and "training may continue" not in message
    assert "run trainer.train() again" in message
    assert failed.value.step == 6  # the engine's error's fields, kept
    assert callback.checkpointer is None and lock_is_free(directory)
    disk.full = False
    trainer, callback = trainer_for(directory, 8)
    trainer.train()
    assert callback.resumed_step == 3  # the version before the failed one


@pytest.mark.parametrize(("kind", "steps"), [("interval", 20), ("placement", 20), ("placement", 4)])
def test_a_broken_policy_stops_training_with_one_line_naming_it(
    tmp_path: Path, kind: str, steps: int
) -> None:
    """The interval policy answers None from step 5, or the placement raises for version 2
    (on the commit thread; the engine raises it at its next call, in training or at its end:
    at the end with 4 steps, as version 2 is the last step's).

    Before, the engine's PolicyError left the callback as it was: the Trainer's traceback
    through the engine, and the engine's message alone (not what the callback did: it
    stopped training, or found it once training had ended). Now it is one line, as a failed
    version's: the callback, the step, the policy's own line, and what to do.
    """
    directory = tmp_path / "ckpts"
    options = {"save_steps": None, **bad_policies.options(kind, directory)}
    trainer, callback = trainer_for(directory, steps, options=options)
    with pytest.raises(PolicyError) as failed:
        trainer.train()
    again = r"run trainer\.train\(\)"
    bad_policies.check_stopped_line(failed.value, "PcframeCallback", again, kind, steps)
    assert callback.checkpointer is None and lock_is_free(directory)
