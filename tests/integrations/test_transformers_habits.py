"""PcframeCallback meets a Trainer user's habits (issue 42): ``train(resume_from_checkpoint=
True)``, the Trainer's own ``save_strategy`` left at its default, a misspelt option, a folder
of another model; the resume and each fallback are WARNING lines on transformers' logging.

A real ``transformers.Trainer`` in this process (the tiny GPT-2 of the restore tests).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers

from pcframe.errors import ConfigError, StateMismatch
from pcframe.integrations.transformers import PcframeCallback
from pcframe.store.directory import CheckpointDir
from tests.integrations.test_transformers_restore import trainer_for

pytestmark = pytest.mark.filterwarnings("ignore::Warning")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def ours(self) -> list[str]:
        return [
            r.getMessage()
            for r in self.records
            if r.levelno == logging.WARNING and r.getMessage().startswith("PcframeCallback")
        ]


@pytest.fixture(autouse=True)
def said() -> Iterator[Lines]:
    """What transformers' logging shows at its default verbosity (WARNING): a handler beside
    its own on the library's root logger, which does not propagate to the root logger."""
    root = logging.getLogger("transformers")
    lines, verbosity = Lines(), transformers.logging.get_verbosity()
    root.addHandler(lines)
    try:
        yield lines
    finally:
        root.removeHandler(lines)
        transformers.logging.set_verbosity(verbosity)


def trainer(directory: Path, steps: int, **kwargs: object) -> tuple:
    return trainer_for(directory, steps, quiet=False, **kwargs)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        # save_last="false" was truthy, and trainer_checkpoints="no" kept the pickles
        ({"save_last": "false"}, "save_last='false': use True or False"),
        ({"trainer_checkpoints": "no"}, "trainer_checkpoints='no': use True or False"),
        ({"keep_global": 2.5}, "keep_global=2.5"),
        ({"protocol_timeout": 0}, "protocol_timeout=0"),
        ({"notices": "SIGTERM"}, "notices='SIGTERM'"),
    ],
)
def test_bad_values_are_refused_when_made(tmp_path: Path, options: dict, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        PcframeCallback(tmp_path, **options)
    assert str(info.value).startswith("PcframeCallback: ") and words in str(info.value)


def test_unknown_and_trainer_options_are_refused_when_made(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match=r"unknown option save_step=3 \(did you mean save_steps="
    ) as e:
        PcframeCallback(tmp_path, save_step=3)
    assert len(str(e.value).splitlines()) == 1
    with pytest.raises(ValueError, match=r"save_total_limit= is the Trainer's; .*keep_last"):
        PcframeCallback(tmp_path, save_total_limit=2)
    with pytest.raises(TypeError, match=r"did you mean keep_last="):
        PcframeCallback(tmp_path, keep_lst=2)


def test_resume_from_checkpoint_true_resumes_pcframes_newest_or_is_refused_at_once(
    tmp_path: Path, said: Lines
) -> None:
    directory = tmp_path / "ckpts"
    fresh, callback = trainer(directory, 6)
    with pytest.raises(ValueError, match=r"holds no pcframe checkpoint; call trainer.train\(\)"):
        fresh.train(resume_from_checkpoint=True)  # the Trainer's "No valid checkpoint found"
    assert fresh.state.global_step == 0 and callback.checkpointer is None  # nothing trained
    fresh.train()
    assert CheckpointDir(directory).committed_versions() == [1, 2]  # steps 3 and 6
    again, callback = trainer(directory, 8)
    again.train(resume_from_checkpoint=True)
    assert callback.resumed_step == 6 and again.state.global_step == 8
    assert said.ours() == [f"PcframeCallback: resumed from {directory} at step 6 (version 2)"]
    # Another folder (a Trainer checkpoint) is not what this callback resumes: said at once.
    other, _ = trainer(directory, 8)
    with pytest.raises(ValueError, match=r"resumes from its own folder .*resume=False"):
        other.train(resume_from_checkpoint=str(tmp_path / "hf-out" / "checkpoint-4"))


@pytest.mark.parametrize("keep", [False, True])
def test_the_trainers_own_checkpoints_are_turned_off_with_one_warning(
    tmp_path: Path, said: Lines, keep: bool
) -> None:
    directory = tmp_path / "ckpts"
    options = {"trainer_checkpoints": keep}
    made, _ = trainer(directory, 4, options=options, save_strategy="steps", save_steps=2)
    made.train()
    written = sorted(p.name for p in (tmp_path / "hf-out").glob("checkpoint-*"))
    if keep:
        assert written == ["checkpoint-2", "checkpoint-4"]  # what the default would write
        return
    assert written == []
    assert len(said.ours()) == 1
    assert said.ours()[0].startswith(
        "PcframeCallback: turned the Trainer's own checkpoints off (save_strategy='steps', "
        "save_steps=2: pickled checkpoint-N folders in"
    )
    assert "trainer_checkpoints=True" in said.ours()[0]


def test_a_fallback_and_the_resume_are_one_warning_each(tmp_path: Path, said: Lines) -> None:
    directory = tmp_path / "ckpts"
    trainer(directory, 6)[0].train()
    store = CheckpointDir(directory)
    data = store.path(2) / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01  # one flipped bit: the chunk checksum fails
    data.write_bytes(bytes(raw))
    made, callback = trainer(directory, 8)
    made.train()
    assert callback.resumed_step == 3
    fallback, resumed = said.ours()
    assert fallback.startswith(f"PcframeCallback: version 2 in {directory} is damaged (")
    assert fallback.endswith("; falling back to an older version")
    assert resumed == f"PcframeCallback: resumed from {directory} at step 3 (version 1)"
    assert all(r.name.startswith("transformers.") for r in said.records)


@pytest.mark.parametrize("ignore_data_skip", [False, True])
def test_uneven_accumulation_warns_only_where_the_trainer_cannot_be_told_the_position(
    tmp_path: Path, said: Lines, ignore_data_skip: bool
) -> None:
    # 7 batches an epoch, windows of 3, 3 and 1: step 4 is one window into epoch 1.
    uneven = {"samples": 28, "gradient_accumulation_steps": 3}
    directory = tmp_path / "ckpts"
    trainer(directory, 4, **uneven)[0].train()
    said.records.clear()
    made, callback = trainer(directory, 6, ignore_data_skip=ignore_data_skip, **uneven)
    made.train()
    assert callback.resumed_step == 4 and made.state.global_step == 6
    resumed = f"PcframeCallback: resumed from {directory} at step 4 (version 2)"
    if not ignore_data_skip:  # the first epoch's _run_epoch is told: exact, nothing to say
        assert said.ours() == [resumed]
        return
    # ignore_data_skip=True: the Trainer skips nothing and numbers the epoch from its first
    # batch (as on a transformers without Trainer._run_epoch); pcframe's dataloader skips.
    warning, line = said.ours()
    assert line == resumed
    assert warning.startswith(
        "PcframeCallback: gradient_accumulation_steps=3 does not divide the 7 batches of an "
        "epoch, and the Trainer cannot be told where in its epoch the resume stands "
        "(ignore_data_skip=True): "
    )


def test_a_folder_of_another_model_is_one_line_naming_it_and_the_fix(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    trainer(directory, 3)[0].train()
    made, callback = trainer(directory, 6, model_class=Wider)
    with pytest.raises(StateMismatch) as refused:
        made.train()
    message = str(refused.value)
    assert message.startswith(f"PcframeCallback: {directory} holds checkpoints of another model")
    assert message.endswith(
        f"give this run its own output_dir, or pass resume=False to start over in {directory}"
    )
    # Short whatever the folder's name (pytest's temporary paths are long, and appear twice).
    assert len(message.splitlines()) == 1 and len(message.replace(str(directory), "D")) < 300
    assert callback.checkpointer is None and made.state.global_step == 0


class Half(transformers.GPT2LMHeadModel):
    """The same model loaded in bfloat16."""

    def __init__(self, config: transformers.GPT2Config) -> None:
        super().__init__(config)
        self.to(torch.bfloat16)


class OneGroup(transformers.Trainer):
    """An optimizer of one param group (the Trainer's own has two: with and without decay)."""

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.args.learning_rate)
        return self.optimizer


class Stepped(transformers.Trainer):
    """A StepLR instead of the Trainer's linear schedule (a LambdaLR)."""

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        optimizer = optimizer if optimizer is not None else self.optimizer
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
        return self.lr_scheduler


# Each: what the resuming Trainer gets instead, and the words naming what does not fit and
# the fix (besides another output_dir or resume=False).
MISFITS: dict[str, tuple[dict[str, Any], str]] = {
    "dtype": (
        {"model_class": Half},
        "holds checkpoints of a model in torch.float32, and this run's is in torch.bfloat16 "
        "(model['transformer.wte.weight']: dtype torch.float32 in the checkpoint, "
        "torch.bfloat16 here; 18 more): build the model in torch.float32 as it was saved, ",
    ),
    "optimizer class": (
        {"optim": "sgd"},
        "holds checkpoints of another optimizer (optimizer: saved from AdamW, this optimizer "
        "is SGD; 2 more): configure the optimizer the run was saved with (its class and "
        "param groups), ",
    ),
    "param groups": (
        {"trainer_class": OneGroup},
        "holds checkpoints of another optimizer (optimizer: 2 param groups in the checkpoint, "
        "1 here): ",
    ),
    "scheduler class": (
        {"trainer_class": Stepped},
        "holds checkpoints of another LR scheduler (scheduler: the checkpoint's scheduler is "
        "LambdaLR, this one StepLR): configure the LR scheduler the run was saved with, ",
    ),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_resume_that_does_not_fit_is_one_line_with_the_callbacks_fix(
    tmp_path: Path, case: str
) -> None:
    """The engine's refusal listed every mismatch on lines of their own and ended "restore(
    strict=False) ..." (and "restore(allow_cast=True) ..."), which a callback's user cannot
    call: one line names the folder, what does not fit and what the user can do."""
    directory = tmp_path / "ckpts"
    trainer(directory, 3)[0].train()
    given, words = MISFITS[case]
    made, callback = trainer(directory, 6, **given)
    with pytest.raises(StateMismatch) as refused:
        made.train()
    message = str(refused.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"PcframeCallback: {directory} holds checkpoints ")
    assert words in message
    assert message.endswith(
        f"give this run its own output_dir, or pass resume=False to start over in {directory}"
    )
    assert "strict=" not in message and "allow_cast" not in message
    mismatches = refused.value.mismatches  # every mismatch the engine found
    assert mismatches and all("\n" not in m for m in mismatches)
    assert (f"; {len(mismatches) - 1} more)" if len(mismatches) > 1 else "") in message
    assert callback.checkpointer is None and made.state.global_step == 0


class Wider(transformers.GPT2LMHeadModel):
    """Another model in the same code: twice the width."""

    def __init__(self, config: transformers.GPT2Config) -> None:
        config.n_embd *= 2
        super().__init__(config)
