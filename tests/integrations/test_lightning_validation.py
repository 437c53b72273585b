"""A version PcframeCheckpoint takes at a step Lightning validates after resumes past that
validation, with the RNG it left: the resumed fit trains as the uninterrupted one.

Real Lightning in this process, a tiny module on CPU whose ``validation_step`` draws from the
global RNG (as MC dropout, a sampling ``generate`` or random crops do). A fit stops right after
a save at a validated step (``max_steps``: what a kill before the next version leaves, the
validation done); a new Trainer resumes it. A version taken before that validation held the
RNG of before it, and Lightning's restart skips the validation of the saved batch: every later
step trained on other dropout masks, and the step's validation was never logged.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

from pcframe import ResumableLoader, ResumableSampler
from pcframe.integrations.lightning import PcframeCheckpoint

# Lightning's advice for a tiny CPU run (num_workers, log intervals) is not under test here.
pytestmark = pytest.mark.filterwarnings("ignore::Warning")

STEPS = 12  # 40 samples in batches of 8: 5 batches an epoch


class Drawing(pl.LightningModule):
    """Dropout in training, a random draw in validation, a step- and an epoch-interval
    scheduler; records what each step computed."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )
        self.losses: dict[int, float] = {}  # global step before the update -> training loss
        self.validated: dict[int, float] = {}  # global step -> the validation's draw
        self.epochs_ended: list[int] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.item()
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        draw = torch.rand(1).item()
        if batch_idx == 0:
            self.validated[self.global_step] = draw
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def on_train_epoch_end(self) -> None:
        self.epochs_ended.append(self.current_epoch)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        steps = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
        epochs = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return [opt], [{"scheduler": steps, "interval": "step"}, {"scheduler": epochs}]


def fit(
    directory: Path,
    steps: int,
    every: int,
    keep_last: int = 3,
    engine: dict[str, Any] | None = None,
    **trainer_options: Any,
) -> Drawing:
    pl.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 8, generator=gen), torch.randn(40, 1, generator=gen))
    train = ResumableLoader(DataLoader(data, batch_size=8, sampler=ResumableSampler(40, seed=3)))
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            PcframeCheckpoint(
                directory, every_n_train_steps=every, keep_last=keep_last, **(engine or {})
            )
        ],
        **trainer_options,
    )
    module = Drawing()
    trainer.fit(module, train_dataloaders=train, val_dataloaders=DataLoader(data, batch_size=16))
    return module


# (validation, the step saved and stopped after): mid-epoch (batch 3 of 5) and an epoch's end
CASES = {
    "val_check_interval": ({"val_check_interval": 3}, 3),
    "end of epoch": ({}, 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_version_at_a_validated_step_resumes_after_its_validation(
    tmp_path: Path, case: str
) -> None:
    validation, stop = CASES[case]
    reference = fit(tmp_path / "reference", STEPS, stop, **validation)
    assert stop in reference.validated
    stopped = fit(tmp_path / "ckpts", stop, stop, **validation)
    resumed = fit(tmp_path / "ckpts", STEPS, stop, **validation)
    assert min(resumed.losses) == stop  # resumed from the version of the stopped step
    # Every step after the resume trains as in the uninterrupted fit (the same dropout).
    assert resumed.losses == {s: v for s, v in reference.losses.items() if s >= stop}
    # Each validation ran once, in one fit or the other, and drew what it drew there.
    assert stopped.validated.keys().isdisjoint(resumed.validated)
    assert {**stopped.validated, **resumed.validated} == reference.validated
    # The resumed fit ends every epoch from the stopped step's on (the stopped fit ended that
    # one too, as a fit stopped by max_steps does; a killed one would not have).
    assert resumed.epochs_ended == reference.epochs_ended == [0, 1, 2]


def test_a_step_interval_plateau_scheduler_is_saved_before_the_validation(tmp_path: Path) -> None:
    """Lightning's restart from a version taken after the validation would step it again
    without its metric (strict: the resumed fit failed); its fits keep the earlier version."""

    def plateau(module: Drawing) -> Any:
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        config = {"scheduler": sched, "interval": "step", "frequency": 3, "monitor": "val_loss"}
        return {"optimizer": opt, "lr_scheduler": config}

    original = Drawing.configure_optimizers
    Drawing.configure_optimizers = plateau  # type: ignore[method-assign]
    try:
        stopped = fit(tmp_path / "ckpts", 3, 3, val_check_interval=3)
        resumed = fit(tmp_path / "ckpts", 9, 3, val_check_interval=3)
    finally:
        Drawing.configure_optimizers = original  # type: ignore[method-assign]
    assert min(resumed.losses) == 3 and max(resumed.losses) == 8
    assert list(stopped.validated) == [3] and list(resumed.validated) == [8]


def test_a_step_whose_validation_raises_is_saved_before_the_fit_ends(tmp_path: Path) -> None:
    """The save waits for the validation: a validation that raised lost the step due before
    it, which the old save before the validation had kept."""
    from pcframe.store.directory import CheckpointDir

    original = Drawing.validation_step

    def failing(module: Drawing, batch: list[torch.Tensor], batch_idx: int) -> None:
        if module.global_step == 3:  # the first validation, after the save due at step 3
            raise RuntimeError("out of memory in validation")
        original(module, batch, batch_idx)

    Drawing.validation_step = failing  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="out of memory in validation"):
            fit(tmp_path / "ckpts", STEPS, 3, val_check_interval=3)
    finally:
        Drawing.validation_step = original  # type: ignore[method-assign]
    store = CheckpointDir(tmp_path / "ckpts")
    assert [store.step_of(v) for v in store.committed_versions()] == [3]


class Seen:
    """Lightning's ``_should_check_val_fx`` as pcframe's code sees it (``pcframe`` frames
    only: Lightning's own loop keeps calling its real one), as in a Lightning that lacks it
    (``None``) or has another one."""

    def __init__(self, real: Any, other: Any) -> None:
        self.real, self.other = real, other

    def __get__(self, loop: Any, owner: type) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.startswith("pcframe."):
            return self.real.__get__(loop, owner)
        if self.other is None:
            raise AttributeError(
                f"{owner.__name__!r} object has no attribute '_should_check_val_fx'"
            )
        return self.other.__get__(loop, owner)


def no_argument(loop: Any) -> bool:  # as an older or a later Lightning might have it
    return False


def not_a_bool(loop: Any, data_fetcher: Any) -> Any:  # truthy, and not Lightning's answer
    return "validates"


OTHER_LIGHTNING = {"missing": None, "another signature": no_argument, "another answer": not_a_bool}


@pytest.mark.parametrize("lightning", list(OTHER_LIGHTNING))
def test_without_lightnings_validation_check_every_version_is_taken_before_its_validation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lightning: str
) -> None:
    """The deferral to ``on_validation_end`` asks Lightning's private
    ``_should_check_val_fx(data_fetcher)``; in a Lightning where it is missing, takes other
    arguments or answers other than a bool, each version is taken where it was before the
    deferral (``on_train_batch_end``), none is lost, and one WARNING line says so. Another
    signature made every batch of the fit fail; a truthy answer put off every step's save to
    a validation that never came (the steps between validations were never saved)."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from pcframe.integrations.lightning import callback as module
    from pcframe.store.directory import CheckpointDir

    real = _TrainingEpochLoop.__dict__["_should_check_val_fx"]
    monkeypatch.setattr(
        _TrainingEpochLoop, "_should_check_val_fx", Seen(real, OTHER_LIGHTNING[lightning])
    )
    monkeypatch.setattr(module, "_TOLD", set(), raising=False)  # told once a process
    asked: list[tuple[int, str]] = []  # (step, the hook the policy was asked in)
    maybe_save = PcframeCheckpoint._maybe_save

    def recorded(self: PcframeCheckpoint, trainer: Any, step: int, metadata: Any) -> None:
        asked.append((step, sys._getframe(1).f_code.co_name))
        maybe_save(self, trainer, step, metadata)

    monkeypatch.setattr(PcframeCheckpoint, "_maybe_save", recorded)
    said = Said()
    logging.getLogger("lightning.pytorch.callbacks.pcframe").addHandler(said)
    try:
        # One version in flight: with two, one whose writes finished after the next one's
        # was discarded (by design), and the versions asserted below were not all there.
        engine = {"max_in_flight": 1}
        fitted = fit(tmp_path / "ckpts", STEPS, 3, 10, engine, val_check_interval=3)
    finally:
        logging.getLogger("lightning.pytorch.callbacks.pcframe").removeHandler(said)
    assert sorted(fitted.validated) == [3, 8]  # Lightning validated as it does
    assert asked == [(step, "on_train_batch_end") for step in range(1, STEPS + 1)]
    store = CheckpointDir(tmp_path / "ckpts")
    assert [store.step_of(v) for v in store.committed_versions()] == [3, 6, 9, 12]
    told = [m for m in said.messages if "cannot tell whether Lightning" in m]
    assert len(told) == 1 and "a version at a validated step is taken before" in told[0]


def test_with_lightnings_validation_check_a_validated_step_is_saved_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same fit with the installed Lightning's own check: steps 3 and 8 wait for their
    validation (the check above is what the deferral reads)."""
    asked: list[tuple[int, str]] = []
    maybe_save = PcframeCheckpoint._maybe_save

    def recorded(self: PcframeCheckpoint, trainer: Any, step: int, metadata: Any) -> None:
        asked.append((step, sys._getframe(1).f_code.co_name))
        maybe_save(self, trainer, step, metadata)

    monkeypatch.setattr(PcframeCheckpoint, "_maybe_save", recorded)
    fitted = fit(tmp_path / "ckpts", STEPS, 3, keep_last=10, val_check_interval=3)
    assert sorted(fitted.validated) == [3, 8]
    after = {3: "on_validation_end", 8: "on_validation_end"}
    assert asked == [(s, after.get(s, "on_train_batch_end")) for s in range(1, STEPS + 1)]


class Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
