"""PcframeCheckpoint's resume is all or nothing, its directory is released on any exit of
``fit``, and a failed version stops the fit saying so (issue 40: 3b, 4, 6).

Real Lightning in this process, a tiny module on CPU. One fit saves a version mid-epoch
(step 7 of 5-batch epochs); each case then resumes it into a trainer where one part of the
saved state is refused, and checks that nothing the fit had (weights, optimizer, scheduler,
loop counters, callbacks, datamodule, data position, RNG) changed; a fit with the right
objects then resumes from the same directory.
"""

from __future__ import annotations

import copy
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

import pcframe.save.persist as persist
from pcframe import Checkpointer, ResumableLoader, ResumableSampler
from pcframe.errors import CheckpointError, PolicyError, SaveError, StateMismatch
from pcframe.integrations.lightning import PcframeCheckpoint
from pcframe.state.rng import capture_rng
from tests.helpers import DiskFull
from tests.integrations import bad_policies
from tests.integrations.killing import tree_differences

# Lightning's advice for a tiny CPU run (num_workers, log intervals) is not under test here.
pytestmark = pytest.mark.filterwarnings("ignore::Warning")

SAVED_STEP = 7  # 40 samples in batches of 8: 5 batches an epoch, step 7 is batch 2 of epoch 1


class Tiny(pl.LightningModule):
    def __init__(self, refuse_weights: bool = False, fail_at: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )
        self.refuse_weights = refuse_weights
        self.fail_at = fail_at  # (step, exception type): raised from inside training_step
        self.break_loops = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.fail_at is not None and self.global_step == self.fail_at[0]:
            raise self.fail_at[1]("raised inside training_step")
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.refuse_weights:  # fails in the engine's apply, after the Lightning section
            raise RuntimeError("these weights are refused")
        return super().load_state_dict(*args, **kwargs)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.break_loops:  # what a hook may do to the dict before the loops load from it
            checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"] = {"damaged": True}


def loader(samples: int = 40, seed: int = 3) -> ResumableLoader:
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, 8, generator=gen), torch.randn(samples, 1))
    return ResumableLoader(
        DataLoader(data, batch_size=8, sampler=ResumableSampler(samples, seed=seed))
    )


class Data(pl.LightningDataModule):
    """A datamodule with state (which shard it is on), handing out a ResumableLoader."""

    def __init__(self, samples: int = 40, seed: int = 3, refuse: bool = False) -> None:
        super().__init__()
        self.samples, self.seed, self.refuse = samples, seed, refuse
        self.shard = 0

    def train_dataloader(self) -> ResumableLoader:
        self.shard = 7
        return loader(self.samples, self.seed)

    def state_dict(self) -> dict[str, Any]:
        return {"shard": self.shard}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.refuse:
            raise ValueError("this datamodule refuses the saved shard")
        self.shard = state["shard"]


class Counter(pl.Callback):
    """A callback with state, saved under its state_key."""

    def __init__(self, refuse: bool = False) -> None:
        self.batches, self.refuse = 0, refuse

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.refuse:
            raise ValueError("this callback refuses its saved state")
        self.batches = state["batches"]


class Probe(pl.Callback):
    """What the fit holds when it starts (before PcframeCheckpoint, which Lightning runs
    last) and when it fails."""

    def __init__(self) -> None:
        self.before: dict[str, Any] | None = None
        self.after: dict[str, Any] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before = snapshot(trainer, pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exc: Any) -> None:
        self.after = snapshot(trainer, pl_module)


def snapshot(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    loaders = trainer.fit_loop._data_source.instance
    data = loaders if isinstance(loaders, ResumableLoader) else None
    return copy.deepcopy(
        {
            "weights": module.state_dict(),
            "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "fit_loop": trainer.fit_loop.state_dict(),
            "restarting": trainer.fit_loop.restarting,
            "resuming": trainer.fit_loop.is_resuming,
            "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
            "datamodule": trainer.datamodule.state_dict() if trainer.datamodule else None,
            "data_position": data.state_dict() if data is not None else None,
            "rng": capture_rng(),
        }
    )


def same(a: Any, b: Any) -> list[str]:
    """Where two snapshots differ."""
    return tree_differences(plain(a), plain(b))


def plain(value: Any) -> Any:
    """numpy's RNG state holds an array: as a list, which tree_differences compares."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def fit(
    directory: Path,
    steps: int,
    module: Tiny | None = None,
    data: Any = None,
    callbacks: list[pl.Callback] | None = None,
    trainer_options: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[pl.Trainer, PcframeCheckpoint]:
    pl.seed_everything(0, verbose=False)
    checkpoint = PcframeCheckpoint(directory, every_n_train_steps=3, **options)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*(callbacks or []), checkpoint],
        **(trainer_options or {}),
    )
    module = module or Tiny()
    if isinstance(data, pl.LightningDataModule):
        trainer.fit(module, datamodule=data)
    else:
        trainer.fit(module, train_dataloaders=data if data is not None else loader())
    return trainer, checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory whose newest version is step 7, mid-epoch, with a datamodule's and a
    callback's state."""
    directory = tmp_path_factory.mktemp("lightning") / "ckpts"
    fit(directory, SAVED_STEP, data=Data(), callbacks=[Counter()])
    return directory


@pytest.fixture
def ckpts(saved: Path, tmp_path: Path) -> Path:
    copied = tmp_path / "ckpts"
    shutil.copytree(saved, copied)
    return copied


# Each: what the refusing fit gets instead (module, datamodule, callback), and the words of
# the refusal. Every part of Lightning's state the callback applies, and the model after it.
REFUSALS: dict[str, tuple[Any, str]] = {
    "sampler seed": (lambda: dict(data=Data(seed=4)), "sampler seed"),
    "shorter dataset": (lambda: dict(data=Data(samples=32)), "samples 40 -> 32"),
    "callback state": (lambda: dict(counter=Counter(refuse=True)), "refuses its saved state"),
    "datamodule state": (lambda: dict(data=Data(refuse=True)), "refuses the saved shard"),
    "loop state": (lambda: dict(break_loops=True), "fit loop state"),
    "model weights": (lambda: dict(module=Tiny(refuse_weights=True)), "weights are refused"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_part_of_the_resume_changes_nothing(ckpts: Path, case: str) -> None:
    make, words = REFUSALS[case]
    given = make()
    module = given.get("module", Tiny())
    module.break_loops = given.get("break_loops", False)
    probe = Probe()
    with pytest.raises(CheckpointError, match=words) as refused:
        fit(
            ckpts,
            20,
            module=module,
            data=given.get("data", Data()),
            callbacks=[probe, given.get("counter", Counter())],
        )
    assert "rolled back, nothing was loaded" in str(refused.value)
    assert probe.before is not None and probe.after is not None
    assert probe.before["global_step"] == 0
    assert not same(probe.before, probe.after)  # weights, optimizer, loops, RNG, ...
    # The directory was released and nothing in it changed: the right objects resume it.
    trainer, checkpoint = fit(ckpts, 9, data=Data(), callbacks=[Counter()])
    assert checkpoint.resumed_step == SAVED_STEP and trainer.global_step == 9


class Reconfigured(Tiny):
    """Tiny with another optimizer or scheduler than the saved fit's (AdamW, StepLR)."""

    def __init__(self, setup: str) -> None:
        super().__init__()
        self.setup = setup

    def configure_optimizers(self) -> Any:
        if self.setup == "sgd":
            opt: Any = torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
        elif self.setup == "groups":  # the last layer at its own rate
            groups = [{"params": self.net[0].parameters()}, {"params": self.net[3].parameters()}]
            opt = torch.optim.AdamW(groups, lr=1e-2)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if self.setup == "scheduler":
            sched: Any = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        else:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# Each: the fit that does not fit the saved one (AdamW, StepLR, float32), and the words of
# the one line naming what does not fit and the fix.
MISFITS: dict[str, tuple[dict[str, Any], str]] = {
    "dtype": (
        {"trainer_options": {"precision": "64-true"}},
        "holds checkpoints of a model in torch.float32, and this run's is in torch.float64 "
        "(model['net.0.weight']: dtype torch.float32 in the checkpoint, torch.float64 here; "
        "5 more): train in the precision it was saved with (the model in torch.float32), ",
    ),
    "optimizer class": (
        {"module": Reconfigured("sgd")},
        "holds checkpoints of another optimizer (optimizer: saved from AdamW, this optimizer "
        "is SGD; 2 more): configure the optimizer the run was saved with",
    ),
    "param groups": (
        {"module": Reconfigured("groups")},
        "holds checkpoints of another optimizer (optimizer: 1 param groups in the checkpoint, "
        "2 here): configure the optimizer",
    ),
    "a training loop's folder": (  # a pcframe Checkpointer's versions: no Lightning state
        {"plain": True},
        "holds checkpoints that the callback did not write (stateful['lightning']: the "
        "checkpoint has no stateful object named 'lightning' (it has []); 1 more): give this "
        "run its own dirpath",
    ),
    "scheduler class": (
        {"module": Reconfigured("scheduler")},
        "holds checkpoints of another LR scheduler (scheduler: the checkpoint's scheduler is "
        "StepLR, this one ExponentialLR): configure the LR scheduler the run was saved with, ",
    ),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_resume_that_does_not_fit_is_one_line_with_the_callbacks_fix(
    ckpts: Path, case: str
) -> None:
    """The engine's refusal listed every mismatch on lines of their own and ended "restore(
    strict=False) ..." (and "restore(allow_cast=True) ..."), which a callback's user cannot
    call: one line names the folder, what does not fit and what the user can do."""
    given, words = dict(MISFITS[case][0]), MISFITS[case][1]
    if given.pop("plain", False):
        shutil.rmtree(ckpts)
        module = Tiny()
        optimizer = module.configure_optimizers()["optimizer"]
        with Checkpointer(ckpts, model=module, optimizer=optimizer) as loop:  # no scheduler
            loop.save(SAVED_STEP)
    with pytest.raises(StateMismatch) as refused:
        fit(ckpts, 20, data=Data(), callbacks=[Counter()], **given)
    message = str(refused.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"PcframeCheckpoint: {ckpts} holds checkpoints ")
    assert words in message
    assert message.endswith(
        f"give this run its own dirpath, or pass resume=False to start over in {ckpts}"
    )
    assert "strict=" not in message and "allow_cast" not in message
    # Every mismatch the engine found stays on the exception.
    mismatches = refused.value.mismatches
    assert mismatches and all("\n" not in m for m in mismatches)
    more = f"; {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
    assert more in message
    # Nothing was loaded and the directory was released: the saved setup resumes it.
    if case != "a training loop's folder":
        trainer, checkpoint = fit(ckpts, 9, data=Data(), callbacks=[Counter()])
        assert checkpoint.resumed_step == SAVED_STEP and trainer.global_step == 9


def test_shorter_data_after_a_version_at_an_epoch_end_is_used_from_the_next_epoch(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "ckpts"
    fit(directory, 5, data=Data())  # 5 batches: the end of epoch 0
    trainer, checkpoint = fit(directory, 8, data=Data(samples=32))  # 4 batches an epoch now
    assert checkpoint.resumed_step == 5 and trainer.global_step == 8
    # Steps 6, 7, 8 are batches 1-3 of epoch 1 (which a stop at max_steps counts as done).
    assert trainer.fit_loop.epoch_loop.batch_progress.current.ready == 3
    assert trainer.current_epoch == 2


def test_longer_epochs_after_a_version_at_an_epoch_end_are_refused(tmp_path: Path) -> None:
    """Lightning's restart would train the first new batches as the rest of the saved epoch."""
    directory = tmp_path / "ckpts"
    fit(directory, 5, data=Data())
    probe = Probe()
    with pytest.raises(CheckpointError, match="more batches now"):
        fit(directory, 8, data=Data(samples=48), callbacks=[probe])
    assert probe.before is not None and probe.after is not None
    assert not same(probe.before, probe.after)


@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt])
def test_any_exit_of_fit_releases_the_directory(tmp_path: Path, raised: type) -> None:
    directory = tmp_path / "ckpts"
    handler = signal.getsignal(signal.SIGINT)
    try:
        # Lightning turns a KeyboardInterrupt into SystemExit(1) (and ignores SIGINT after).
        expected = SystemExit if raised is KeyboardInterrupt else RuntimeError
        with pytest.raises(expected):
            fit(directory, 20, module=Tiny(fail_at=(4, raised)))
    finally:
        signal.signal(signal.SIGINT, handler)
    # The version of step 3 is there; the same process opens the directory again.
    trainer, checkpoint = fit(directory, 5)
    assert checkpoint.resumed_step == 3 and trainer.global_step == 5


class FillDisk(pl.Callback):
    """The disk fills before the version of step 6 is written; at step 7 the writer has
    failed it (this hook runs before PcframeCheckpoint's, which Lightning runs last)."""

    def __init__(self, disk: DiskFull) -> None:
        self.disk = disk
        self.stopped_at: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step == 6:
            (checkpoint,) = [cb for cb in trainer.callbacks if isinstance(cb, PcframeCheckpoint)]
            assert checkpoint.checkpointer is not None
            checkpoint.checkpointer.wait()  # the version of step 3 is committed (a busy host)
            self.disk.full = True
        elif trainer.global_step == 7:
            assert self.disk.refused.wait(60)
            time.sleep(0.2)  # the failed version is handed over to the training thread

    def on_exception(self, trainer: pl.Trainer, *args: Any) -> None:
        self.stopped_at = trainer.global_step


def test_a_failed_version_stops_the_fit_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskFull()
    monkeypatch.setattr(persist, "os", disk)
    directory = tmp_path / "ckpts"
    fill = FillDisk(disk)
    with pytest.raises(SaveError) as failed:
        fit(directory, 40, callbacks=[fill], max_in_flight=1)
    message = str(failed.value)
    said = re.match(r"PcframeCheckpoint stopped training at step (\d+): ", message)
    assert said is not None, message
    assert int(said[1]) == fill.stopped_at and fill.stopped_at >= 7  # it did stop there
    assert "no space left on device" in message and "training may continue" not in message
    assert "run trainer.fit(...) again" in message
    assert failed.value.step == 6  # the engine's error's fields, kept
    disk.full = False
    _, checkpoint = fit(directory, 8)
    assert checkpoint.resumed_step == 3  # the version before the failed one


@pytest.mark.parametrize(("kind", "steps"), [("interval", 20), ("placement", 20), ("placement", 4)])
def test_a_broken_policy_stops_the_fit_with_one_line_naming_it(
    tmp_path: Path, kind: str, steps: int
) -> None:
    """The interval policy answers None from step 5, or the placement raises for version 2
    (on the commit thread; the engine raises it at its next call, in the fit or at its end:
    at the end with 4 steps, as version 2 is the last step's).

    Before, the engine's PolicyError left the callback as it was: Lightning's traceback
    through the engine, and a message of the engine's alone (not what the callback did: it
    stopped the fit, or found it once the fit had ended). Now it is one line, as a failed
    version's: the callback, the step, the policy's own line, and what to do.
    """
    directory = tmp_path / "ckpts"
    pl.seed_everything(0, verbose=False)
    checkpoint = PcframeCheckpoint(directory, **bad_policies.options(kind, directory))
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[checkpoint])  # fmt: skip
    with pytest.raises(PolicyError) as failed:
        trainer.fit(Tiny(), train_dataloaders=loader())
    again = r"run trainer\.fit\(\.\.\.\)"
    bad_policies.check_stopped_line(failed.value, "PcframeCheckpoint", again, kind, steps)
    assert checkpoint.checkpointer is None  # closed: the directory is released


def test_ckpt_path_into_the_callbacks_folder_and_twin_callbacks_are_refused_by_name(
    ckpts: Path,
) -> None:
    """trainer.fit(ckpt_path=<the folder or a version>) failed in Lightning's loader with a
    bare IsADirectoryError; two callbacks on one folder with advice for a notebook."""
    for path in (ckpts, ckpts / "v00000001"):
        checkpoint = PcframeCheckpoint(ckpts, every_n_train_steps=3)
        trainer = pl.Trainer(max_steps=9, accelerator="cpu", devices=1, logger=False,
                             enable_progress_bar=False, callbacks=[checkpoint])  # fmt: skip
        with pytest.raises(
            ValueError, match=r"names PcframeCheckpoint's own folder.*drop ckpt_path"
        ):
            trainer.fit(Tiny(), train_dataloaders=loader(), ckpt_path=str(path))
        # Lightning's loader is its own again after the fit: a .ckpt file loads as ever.
        assert "load_checkpoint" not in vars(trainer.strategy.checkpoint_io)
    with pytest.raises(ValueError, match="two PcframeCheckpoint callbacks save to"):
        fit(ckpts, 9, callbacks=[PcframeCheckpoint(ckpts)])
    trainer, checkpoint = fit(ckpts, 9)  # nothing held: the folder resumes as before
    assert checkpoint.resumed_step == SAVED_STEP and trainer.global_step == 9
    for bad in (5, b"ckpts"):
        with pytest.raises(TypeError, match="dirpath="):
            PcframeCheckpoint(bad)
    with pytest.raises(ValueError, match="dirpath= is required"):
        PcframeCheckpoint("  ")
