"""PcframeCallback at the steps the Trainer evaluates: the version is taken after the
evaluation, as the Trainer's own checkpoint is.

The Trainer evaluates a step after the callbacks' ``on_step_end``, and the evaluation draws
from the global RNG (the eval dataloader's iterator draws its base seed); a resumed run does
not evaluate that step again. A version taken before the evaluation made every later step's
dropout differ from an uninterrupted run's.

A real ``transformers.Trainer`` in this process: a tiny GPT-2 from a config on CPU (dropout
on), 8 steps of 4 samples (4 steps an epoch), 4 eval samples. The interrupted run stops after
a saved step (``should_training_stop``) and a new Trainer resumes it, as a new process after
a SIGKILL would.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from pcframe.policies import ManualNoticeSource
from pcframe.restore.reader import load_version
from pcframe.store.directory import CheckpointDir

# transformers' advice for a tiny CPU run (pin_memory, tokens) is not under test here.
pytestmark = pytest.mark.filterwarnings("ignore::Warning")

STEPS = 8


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int, length: int = 12, vocab: int = 32) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recording(Trainer):
    """Records the training loss of each step (one batch a step)."""

    losses: dict[int, float]
    pcframe: Any  # its PcframeCallback

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.losses[self.state.global_step + 1] = loss.item()
        return loss


class StopAfter(transformers.TrainerCallback):
    """Ends training after ``step`` (the end of an interrupted run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def trainer_for(
    directory: Path,
    save_steps: int,
    callbacks: tuple[Any, ...] = (),
    options: dict[str, Any] | None = None,
    eval_dataset: Any = None,
    **arguments: Any,
) -> Recording:
    from pcframe.integrations.transformers import PcframeCallback

    transformers.logging.set_verbosity_error()
    transformers.set_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    assert config.resid_pdrop > 0  # dropout draws from the global RNG at every step
    args = TrainingArguments(
        output_dir=str(directory.parent / "hf-out"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=5e-3,
        seed=0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **arguments,
    )
    callback = PcframeCallback(directory, save_steps=save_steps, keep_last=10, **(options or {}))
    trainer = Recording(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Tokens(16, seed=1),
        eval_dataset=eval_dataset if eval_dataset is not None else Tokens(4, seed=2),
        callbacks=[*callbacks, callback],
    )
    trainer.losses, trainer.pcframe = {}, callback
    return trainer


def saved_steps(directory: Path) -> list[int]:
    store = CheckpointDir(directory)
    return [load_version(store.path(v)).manifest.step for v in store.committed_versions()]


@pytest.mark.parametrize(
    ("save_steps", "stop", "evaluation"),
    [
        (3, 6, {"eval_strategy": "steps", "eval_steps": 3}),  # saved and evaluated
        # the end of epoch 0, evaluated; and saved, evaluated after it (slow: 2 Trainers each)
        pytest.param(4, 4, {"eval_strategy": "epoch"}, marks=pytest.mark.slow),
        pytest.param(3, 3, {"eval_strategy": "steps", "eval_steps": 2}, marks=pytest.mark.slow),
    ],
    ids=["eval_steps==save_steps", "eval_at_epoch_end", "eval_elsewhere"],
)
def test_a_run_resumed_after_an_evaluated_step_trains_as_an_uninterrupted_one(
    tmp_path: Path, save_steps: int, stop: int, evaluation: dict[str, Any]
) -> None:
    reference = trainer_for(tmp_path / "reference", save_steps, **evaluation)
    reference.train()
    assert sorted(reference.losses) == list(range(1, STEPS + 1))

    first = trainer_for(tmp_path / "run", save_steps, callbacks=(StopAfter(stop),), **evaluation)
    first.train()
    assert max(saved_steps(tmp_path / "run")) == stop
    resumed = trainer_for(tmp_path / "run", save_steps, **evaluation)
    resumed.train()
    assert resumed.pcframe.resumed_step == stop
    assert sorted(resumed.losses) == list(range(stop + 1, STEPS + 1))

    losses = {**first.losses, **resumed.losses}
    differ = [s for s in losses if losses[s] != reference.losses[s]]
    assert not differ, f"steps whose loss differs from the uninterrupted run's: {differ}"
    # The resumed run evaluated the steps after the resumed one, not that step again.
    evaluated = [e["step"] for e in resumed.state.log_history if "eval_loss" in e]
    assert evaluated == [e["step"] for e in reference.state.log_history if "eval_loss" in e]


def test_with_several_eval_sets_the_version_is_taken_after_the_last_ones_evaluation(
    tmp_path: Path,
) -> None:
    """A dict ``eval_dataset``: the Trainer evaluates each set in turn, each with its own
    ``on_evaluate``, and each draws from the global RNG (its eval dataloader's iterator).
    The version taken at the first one's held the RNG of before the others: every step
    after the resume trained on other dropout masks."""

    def sets() -> dict[str, Tokens]:  # "near" prefixes "near_far"'s metric names
        return {"near": Tokens(4, seed=2), "near_far": Tokens(8, seed=3), "far": Tokens(4, 4)}

    evaluation = {"eval_strategy": "steps", "eval_steps": 3}
    reference = trainer_for(tmp_path / "reference", 3, eval_dataset=sets(), **evaluation)
    reference.train()
    first = trainer_for(
        tmp_path / "run", 3, callbacks=(StopAfter(6),), eval_dataset=sets(), **evaluation
    )
    first.train()
    assert saved_steps(tmp_path / "run") == [3, 6]
    resumed = trainer_for(tmp_path / "run", 3, eval_dataset=sets(), **evaluation)
    resumed.train()
    assert resumed.pcframe.resumed_step == 6
    losses = {**first.losses, **resumed.losses}
    differ = [s for s in losses if losses[s] != reference.losses[s]]
    assert not differ, f"steps whose loss differs from the uninterrupted run's: {differ}"
    # Each version holds every set's evaluation of its step (taken after the last one).
    store = CheckpointDir(tmp_path / "run")
    history = load_version(store.path(2)).state_tree()["stateful"]["trainer_state"]
    logged = {key for entry in history["log_history"] for key in entry if key.endswith("_loss")}
    assert logged == {"eval_near_loss", "eval_near_far_loss", "eval_far_loss"}
    assert [e["step"] for e in history["log_history"] if "eval_far_loss" in e] == [3, 6]


def test_each_due_step_is_saved_once_after_its_evaluation(tmp_path: Path) -> None:
    trainer = trainer_for(tmp_path / "run", 3, eval_strategy="steps", eval_steps=2)
    trainer.train()
    # 3 and 6 by the policy, 8 as the last step (save_last)
    assert saved_steps(tmp_path / "run") == [3, 6, 8]
    store = CheckpointDir(tmp_path / "run")
    for version, step in zip(store.committed_versions(), [3, 6, 8], strict=True):
        history = load_version(store.path(version)).state_tree()["stateful"]["trainer_state"]
        evaluations = [e["step"] for e in history["log_history"] if "eval_loss" in e]
        # 6 and 8 are evaluated: their versions hold that evaluation, taken after it.
        assert evaluations == [s for s in (2, 4, 6, 8) if s <= step]


class Notify(transformers.TrainerCallback):
    """A preemption notice at ``step``; records, as each evaluation ends (before
    PcframeCallback's on_evaluate), the steps already saved."""

    def __init__(self, source: ManualNoticeSource, step: int, directory: Path) -> None:
        self.source, self.step, self.directory = source, step, directory
        self.saved_at_evaluation: dict[int, list[int]] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            self.source.trigger(time.monotonic(), window=600.0)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.saved_at_evaluation[state.global_step] = saved_steps(self.directory)


def test_a_preemption_notice_saves_before_the_evaluation(tmp_path: Path) -> None:
    source = ManualNoticeSource()
    notify = Notify(source, 6, tmp_path / "run")
    trainer = trainer_for(
        tmp_path / "run",
        3,
        callbacks=(notify, StopAfter(6)),
        options={"notices": [source]},
        eval_strategy="steps",
        eval_steps=3,
    )
    trainer.train()
    # Step 3 waited for its evaluation; step 6, with a notice pending, did not.
    assert notify.saved_at_evaluation[3] == []
    assert 6 in notify.saved_at_evaluation[6]
    assert saved_steps(tmp_path / "run") == [3, 6]


def test_a_step_whose_evaluation_raises_is_saved_before_train_ends(tmp_path: Path) -> None:
    """The save waits for the evaluation: an evaluation that raises (an OOM in it, a bug in
    compute_metrics) lost the step due before it, which the old save before it had kept."""
    directory = tmp_path / "ckpt"
    trainer = trainer_for(directory, save_steps=3, eval_strategy="steps", eval_steps=3)
    evaluate = trainer.evaluate

    def failing(*args: Any, **kwargs: Any) -> Any:
        if trainer.state.global_step == 6:
            raise RuntimeError("out of memory in evaluation")
        return evaluate(*args, **kwargs)

    trainer.evaluate = failing
    with pytest.raises(RuntimeError, match="out of memory in evaluation"):
        trainer.train()
    assert saved_steps(directory) == [3, 6]
