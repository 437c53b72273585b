"""The ``lightning`` section of a version: what a Lightning checkpoint holds besides the
tensors of model and optimizer (the fit loop's state with its progress counters and the
positions of resumable dataloaders, callbacks' states, precision plugin, datamodule, what
``on_save_checkpoint`` hooks add), captured at each save and applied inside the engine's
restore, every change with its undo; plus the checks that a saved data position still means
the same samples in this fit's data (another dataset, another number of processes)."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.loops import _Loop
from lightning.pytorch.loops.progress import _BaseProgress
from lightning.pytorch.utilities import CombinedLoader

from pcframe.integrations._common import (
    RestoredSection,
    Undo,
    data_shape,
    length,
    shape_changes,
)
from pcframe.integrations.lightning.messages import DATA, n_processes, tell
from pcframe.state.rng import capture_rng, restore_rng


class LightningSection(RestoredSection):
    """The ``lightning`` entry of a version: Lightning's checkpoint dict minus model/optimizer.

    ``capture`` runs on the training thread inside ``save()``; the engine encodes it at once,
    so later changes to the loops never leak into a version being written. ``apply`` runs
    inside ``Checkpointer.restore`` before the model, optimizer and RNG are loaded, each of
    its changes undone if anything of the version is refused (:class:`RestoredSection`).
    """

    def __init__(self, owner: pl.Callback) -> None:
        super().__init__()
        self.owner = owner
        self.trainer: pl.Trainer | None = None
        self.module: pl.LightningModule | None = None
        self.applied: dict[str, Any] | None = None  # the state the last restore applied

    def bind(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.trainer, self.module = trainer, module

    def _others(self) -> list[pl.Callback]:
        assert self.trainer is not None
        return [cb for cb in self.trainer.callbacks if cb is not self.owner]

    def capture(self) -> dict[str, Any]:
        trainer, module = self.trainer, self.module
        assert trainer is not None and module is not None, "saved before on_fit_start"
        checkpoint: dict[str, Any] = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "pytorch-lightning_version": pl.__version__,
            "loops": {"fit_loop": trainer.fit_loop.state_dict()},
            "callbacks": {},
            # What a mid-epoch position refers to, checked when it is resumed: the data of
            # each loader (as this rank sees it) and the number of processes sharing it.
            DATA: {
                "train_data": [data_shape(dl) for dl in _flat(trainer.train_dataloader)],
                "world_size": trainer.world_size,
            },
        }
        for callback in self._others():
            state = callback.state_dict()
            if state:
                checkpoint["callbacks"][callback.state_key] = state
        precision = trainer.precision_plugin.state_dict()
        if precision:
            checkpoint["precision_plugin"] = precision
        if trainer.datamodule is not None:
            checkpoint["datamodule"] = trainer.datamodule.state_dict()
        # The hooks Lightning's own save runs: they add their extras to the dict.
        for callback in self._others():
            callback.on_save_checkpoint(trainer, module, checkpoint)
        module.on_save_checkpoint(checkpoint)
        return checkpoint

    def apply(self, state: dict[str, Any], undo: Undo) -> None:
        """Lightning's restore order: the module's hook, datamodule, callbacks' hooks and
        states, precision plugin, fit loop; then the train dataloaders' positions (which
        Lightning itself would load later, in ``fit_loop.setup_data``, after this restore
        could no longer be undone), each checked against the data it was saved in."""
        trainer, module = self.trainer, self.module
        assert trainer is not None and module is not None
        loops = state.get("loops")
        fit_state = loops.get("fit_loop") if isinstance(loops, dict) else None
        if not isinstance(fit_state, dict):
            raise ValueError("the saved Lightning state has no fit loop state (loops/fit_loop)")
        saved_callbacks = state.get("callbacks", {})
        if not isinstance(saved_callbacks, dict):
            raise ValueError("the saved Lightning state's callbacks entry is not a dict")
        rng = capture_rng()  # user hooks and dataloader hooks may draw
        undo.push(lambda: restore_rng(rng))
        with _part("the LightningModule's on_load_checkpoint"):
            module.on_load_checkpoint(state)
        if trainer.datamodule is not None and "datamodule" in state:
            with _part(f"the datamodule {type(trainer.datamodule).__name__}"):
                undo.load(trainer.datamodule, state["datamodule"])
        others = self._others()
        for callback in others:
            with _part(f"callback {callback.state_key}'s on_load_checkpoint"):
                callback.on_load_checkpoint(trainer, module, state)
        for callback in others:
            saved = saved_callbacks.get(callback.state_key)
            if saved:  # as Lightning: an empty state is not loaded
                with _part(f"callback {callback.state_key}"):
                    undo.load(callback, saved)
        if "precision_plugin" in state:
            with _part("the precision plugin"):
                undo.load(trainer.precision_plugin, state["precision_plugin"])
        undo.push(_loops_as_now(trainer.fit_loop))
        with _part("the fit loop state"):
            trainer.fit_loop.load_state_dict(fit_state)
        self._data_position(state, fit_state, undo)
        self.applied = state

    def apply_from_rank_zero(self, state: dict[str, Any]) -> None:
        """A rank beyond the saved job's (the job grew): saved rank 0's Lightning state,
        applied after the engine's restore, without rank 0's data positions (this rank's
        loaders start where fresh ones start). Undone if refused."""
        state = copy.deepcopy(state)
        loops = state.get("loops")
        fit_state = loops.get("fit_loop") if isinstance(loops, dict) else None
        inner = fit_state.get("state_dict") if isinstance(fit_state, dict) else None
        if isinstance(inner, dict):
            inner["combined_loader"] = []
        undo = Undo()
        try:
            self.apply(state, undo)
        except BaseException:
            undo.run()
            raise

    def _data_position(self, state: dict[str, Any], fit_state: dict[str, Any], undo: Undo) -> None:
        trainer = self.trainer
        assert trainer is not None
        inner = fit_state.get("state_dict")
        positions = inner.get("combined_loader", []) if isinstance(inner, dict) else []
        ours = state.get(DATA)
        recorded = ours.get("train_data") if isinstance(ours, dict) else None
        if not positions and not isinstance(recorded, list):
            return  # nothing saved about the data (a plain DataLoader, an older version)
        loaders = _train_loaders(trainer)
        if loaders is None:
            return  # no training data in this fit: Lightning loads no position either
        mid_epoch = _mid_epoch(fit_state)
        saved_world = ours.get("world_size", 1) if isinstance(ours, dict) else 1
        if saved_world != trainer.world_size and mid_epoch and _sized(loaders):
            raise ValueError(
                f"the version was saved mid-epoch (batch {_batch_in_epoch(fit_state)} of its "
                f"epoch) by {n_processes(saved_world)} and this fit runs {trainer.world_size}: "
                "the rest of that epoch was split among the old processes. Resume with "
                f"{n_processes(saved_world)}, or from a version saved at the end of an epoch "
                "(every_n_epochs=N), or start fresh (resume=False)"
            )
        changes = _data_changes(recorded, loaders) if isinstance(recorded, list) else []
        if saved_world != trainer.world_size:
            changes = [f"{c} ({n_processes(saved_world)} -> {trainer.world_size})" for c in changes]
        if changes and mid_epoch:
            raise ValueError(
                f"the version was saved mid-epoch (batch {_batch_in_epoch(fit_state)} of its "
                f"epoch) and the train data has changed since ({'; '.join(changes)}): resuming "
                "would skip other samples than the ones trained. Resume with the same data, "
                "from a version saved at the end of an epoch (resume=<version>), or start "
                "fresh (resume=False)"
            )
        if changes and _longer_epochs(recorded, loaders):
            # Lightning's restart compares the batches of the saved epoch with the epoch's
            # length now: shorter than now, it would train the first new batches as the rest
            # of that epoch.
            raise ValueError(
                f"the version was saved at the end of an epoch and an epoch of the train data "
                f"has more batches now ({'; '.join(changes)}): Lightning would count the first "
                "batches of the new data to the saved epoch. Resume with the same data, or "
                "start fresh (resume=False)"
            )
        if changes:
            tell(
                trainer,
                logging.WARNING,
                "PcframeCheckpoint: the train data has changed since the version was saved "
                f"({'; '.join(changes)}); it was saved at the end of an epoch, so the next "
                "epoch uses the new data",
            )
        resumable = [dl for dl in loaders if isinstance(dl, _Stateful)]
        if positions and len(positions) != len(resumable):
            raise ValueError(
                f"the version holds the data positions of {len(positions)} train dataloaders "
                f"and this fit has {len(resumable)} with state_dict/load_state_dict: give the "
                "same train dataloaders, or start fresh (resume=False)"
            )
        # Loaded here, where a refusal (another sampler seed, say) can still be undone;
        # Lightning loads the same positions again when it sets up the data. None saved (a
        # rank beyond the saved job's, given saved rank 0's loops without its positions):
        # this rank's loaders start where fresh ones start.
        for loader, position in zip(resumable if positions else [], positions, strict=True):
            with _part(f"the train dataloader {type(loader).__name__}'s data position"):
                undo.load(loader, position)


@contextlib.contextmanager
def _part(name: str) -> Iterator[None]:
    """Name the part of Lightning's state that refused the version in the error."""
    try:
        yield
    except Exception as exc:
        raise ValueError(f"{name} refused the saved state ({type(exc).__name__}: {exc})") from exc


def _flat(loaders: Any) -> list[Any]:
    """The train dataloaders, as Lightning's CombinedLoader flattens them."""
    if loaders is None:
        return []
    if isinstance(loaders, CombinedLoader):
        return list(loaders.flattened)
    return list(CombinedLoader(loaders).flattened)


def _train_loaders(trainer: pl.Trainer) -> list[Any] | None:
    """The train dataloaders this fit will use (``None``: it trains on none), requested as
    ``fit_loop.setup_data`` requests them: the given instance, or the ``train_dataloader()``
    hook of the module or datamodule (called once more for that)."""
    source = getattr(trainer.fit_loop, "_data_source", None)
    if source is None or not source.is_defined() or trainer.limit_train_batches == 0:
        return None
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
    from lightning.pytorch.trainer.states import RunningStage

    loaders = _flat(_request_dataloader(source))
    return [_as_trained(trainer, dl, RunningStage.TRAINING) for dl in loaders]


def _as_trained(trainer: pl.Trainer, loader: Any, stage: Any) -> Any:
    """The loader as ``fit_loop.setup_data`` will train on it: several processes, a plain
    DataLoader gets Lightning's DistributedSampler (its epochs are this rank's part)."""
    try:
        return trainer._data_connector._prepare_dataloader(loader, shuffle=True, mode=stage)
    except Exception:  # a DataLoader subclass Lightning cannot rebuild: as given
        return loader


def _sized(loaders: list[Any]) -> bool:
    return all(length(dl) is not None for dl in loaders)


def _data_changes(recorded: list[Any], loaders: list[Any]) -> list[str]:
    if len(recorded) != len(loaders):
        return [f"{len(recorded)} train dataloaders -> {len(loaders)}"]
    changes = []
    for i, (saved, loader) in enumerate(zip(recorded, loaders, strict=True)):
        prefix = f"dataloader {i}: " if len(loaders) > 1 else ""
        changes += [prefix + change for change in shape_changes(saved, data_shape(loader))]
    return changes


def _longer_epochs(recorded: list[Any], loaders: list[Any]) -> bool:
    if len(recorded) != len(loaders):
        return True
    for saved, loader in zip(recorded, loaders, strict=True):
        before, now = saved.get("batches") if isinstance(saved, dict) else None, length(loader)
        if before is None or now is None or now > before:
            return True
    return False


def _mid_epoch(fit_state: dict[str, Any]) -> bool:
    """Whether the saved fit loop stopped inside an epoch (its last batch not reached)."""
    progress = fit_state.get("epoch_loop.batch_progress")
    if not isinstance(progress, dict):
        return False
    return _batch_in_epoch(fit_state) > 0 and not progress.get("is_last_batch", False)


def _batch_in_epoch(fit_state: dict[str, Any]) -> int:
    progress = fit_state.get("epoch_loop.batch_progress") or {}
    current = progress.get("current") if isinstance(progress, dict) else None
    ready = current.get("ready", 0) if isinstance(current, dict) else 0
    return ready if isinstance(ready, int) else 0


def _loops_as_now(loop: _Loop) -> Callable[[], None]:
    """An undo of ``loop.load_state_dict``: every loop's attributes (flags, what its
    ``on_load_checkpoint`` set) and every progress counter, as they are now."""
    kept: list[tuple[Any, dict[str, Any], dict[str, dict[str, Any]]]] = []

    def keep(obj: Any) -> None:
        attributes = dict(vars(obj))
        counters = {
            name: value.state_dict()
            for name, value in attributes.items()
            if isinstance(value, _BaseProgress)
        }
        kept.append((obj, attributes, counters))
        for value in attributes.values():
            if isinstance(value, _Loop):
                keep(value)

    keep(loop)

    def put_back() -> None:
        for obj, attributes, counters in kept:
            vars(obj).clear()
            vars(obj).update(attributes)
            for name, counter in counters.items():
                attributes[name].load_state_dict(counter)  # changed in place by the load

    return put_back
