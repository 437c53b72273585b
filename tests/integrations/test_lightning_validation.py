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


def fit(directory: Path, steps: int, every: int, **trainer_options: Any) -> Drawing:
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
        callbacks=[PcframeCheckpoint(directory, every_n_train_steps=every)],
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
