"""``PcframeCheckpoint``: pcframe's engine as a Lightning checkpoint callback.

    checkpoint = PcframeCheckpoint("ckpts", every_n_train_steps=50)  # or policy="young"
    trainer = L.Trainer(max_steps=1000, callbacks=[checkpoint])
    trainer.fit(model, train_dataloaders=loader)  # resumes from the newest valid version

The callback owns one :class:`pcframe.Checkpointer` for the duration of ``fit``. It is made in
``on_fit_start``, the first hook where Lightning's strategy has built the optimizers and
schedulers, and before Lightning itself would restore loops and optimizers. The engine gets the
LightningModule, the (one) optimizer, the schedulers and a ``lightning`` section holding what
Lightning's own checkpoints hold besides tensors of the model: the fit loop's state (progress
counters and the state of resumable dataloaders), callbacks' states, precision plugin and
datamodule state, and what ``on_save_checkpoint`` hooks add. Saves happen in
``on_train_batch_end`` after each optimizer step the policy picks (the same point as
``ModelCheckpoint(every_n_train_steps=...)``), so Lightning's restart logic, written for that
point, resumes the loops; the engine's pre-hook on ``optimizer.step`` keeps the next update from
changing the weights before the snapshot is copied.

A resume is all or nothing: the ``lightning`` section applies Lightning's state, and the
train dataloaders' positions checked against the data they were saved in, inside
``Checkpointer.restore`` and before the weights, each change with its undo; a refusal of any
part leaves module, optimizer, loops, callbacks, datamodule and RNG as they were.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pcframe.integrations._common import (
    RestoredSection,
    Undo,
    check_resume,
    close_quietly,
    data_shape,
    length,
    require_library,
    resolve_policy,
    shape_changes,
    stopped_by,
)

pl = require_library("lightning.pytorch", "lightning", "lightning")

from lightning.fabric.utilities.types import _Stateful  # noqa: E402  (after the guard)
from lightning.pytorch.loops import _Loop  # noqa: E402
from lightning.pytorch.loops.progress import _BaseProgress  # noqa: E402
from lightning.pytorch.utilities import CombinedLoader  # noqa: E402

from pcframe.checkpointer import Checkpointer  # noqa: E402
from pcframe.errors import SaveError  # noqa: E402
from pcframe.policies.base import IntervalPolicy  # noqa: E402
from pcframe.state.rng import capture_rng, restore_rng  # noqa: E402

log = logging.getLogger("pcframe")

__all__ = ["PcframeCheckpoint"]

SECTION = "lightning"  # the stateful name of Lightning's own state in every version
DATA = "pcframe"  # pcframe's entry in that section: the shape of the train data, per loader
AGAIN = "run trainer.fit(...) again"  # what resumes from the last committed version


class PcframeCheckpoint(pl.callbacks.Checkpoint):
    """Save with pcframe under an interval policy; resume ``trainer.fit`` from the newest version.

    Args:
        dirpath: the checkpoint directory (one writer process at a time), as in ModelCheckpoint.
        policy: a :mod:`pcframe.policies` interval policy or its registered name
            (``"young"``, ``"fixed_steps"``, ...); ``policy_options`` are its arguments.
        every_n_train_steps: shorthand for ``policy=FixedSteps(n)`` (ModelCheckpoint's name).
            Neither given: every 100 optimizer steps.
        save_last: save the step after which ``fit`` stops (``max_steps``, ``max_epochs`` or a
            callback's ``trainer.should_stop``) if the policy did not pick it (on by default,
            unlike ModelCheckpoint: a finished run should be resumable and exportable).
        resume: ``"auto"`` loads the newest valid version when ``fit`` starts (a corrupt one is
            quarantined and the previous tried), ``False`` starts fresh, an int loads that
            version. ``trainer.fit(ckpt_path=...)`` wins over ``"auto"``.
        monitor, save_top_k: not supported (pcframe keeps the newest ``keep_last`` versions);
            add a ModelCheckpoint next to this callback for best-model files.
        engine_options: :class:`pcframe.config.EngineConfig` fields, e.g. ``max_in_flight=2``,
            ``keep_last=3``.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        *,
        policy: IntervalPolicy | str | None = None,
        policy_options: dict[str, Any] | None = None,
        every_n_train_steps: int | None = None,
        save_last: bool = True,
        resume: bool | int | str = "auto",
        monitor: str | None = None,
        save_top_k: int | None = None,
        **engine_options: Any,
    ) -> None:
        if monitor is not None or save_top_k is not None:
            raise ValueError(
                "PcframeCheckpoint does not rank versions by a metric (monitor=/save_top_k=): it "
                "keeps the newest keep_last=N versions; add ModelCheckpoint(monitor=..., "
                "save_top_k=...) next to it for best-model files"
            )
        if dirpath is None or str(dirpath) == "":
            raise ValueError("PcframeCheckpoint: dirpath= is required (the checkpoint directory)")
        self.dirpath = Path(dirpath)
        self.policy = resolve_policy(
            policy, every_n_train_steps, "every_n_train_steps", policy_options
        )
        self.save_last = save_last
        self.resume = check_resume(resume)
        self.engine_options = engine_options
        self.checkpointer: Checkpointer | None = None
        self.resumed_step: int | None = None  # the step the last fit resumed from (None: fresh)
        self._section = _LightningSection(self)
        self._last_step: int | None = None

    @property
    def state_key(self) -> str:
        return f"PcframeCheckpoint{{dirpath={str(self.dirpath)!r}}}"

    # --- lifecycle -------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.world_size > 1:
            raise RuntimeError(
                f"PcframeCheckpoint runs in one process; this trainer has world_size="
                f"{trainer.world_size}: use pcframe.distributed.DistributedCheckpointer in a "
                "custom loop, or one PcframeCheckpoint dirpath per rank is not supported yet"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.checkpointer is not None:  # an earlier fit ended without on_exception/teardown
            self._close(clean=False)
        optimizers = list(trainer.optimizers)
        if len(optimizers) > 1:
            raise ValueError(
                f"PcframeCheckpoint gates one optimizer; configure_optimizers returned "
                f"{len(optimizers)}: combine the parameter groups into one optimizer"
            )
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        scheduler: Any = None
        if len(schedulers) == 1:
            scheduler = schedulers[0]
        elif schedulers:
            scheduler = _Schedulers(schedulers)
        self._section.bind(trainer, pl_module)
        self.checkpointer = Checkpointer(
            self.dirpath,
            model=pl_module,
            optimizer=optimizers[0] if optimizers else None,
            scheduler=scheduler,
            stateful={SECTION: self._section},
            policy=self.policy,
            **self.engine_options,
        )
        self.resumed_step = None
        self._last_step = trainer.global_step
        if self.resume is False:
            return
        if trainer.ckpt_path is not None:
            log.info(
                "PcframeCheckpoint: trainer.fit(ckpt_path=...) given; not resuming from pcframe"
            )
            return
        # The section applies loops, callbacks, datamodule and data position inside the
        # restore, first of all objects: a refusal of any part (or of the model after it)
        # leaves model, optimizer, counters and RNG as they were (on_exception then closes).
        with self._section.restoring():
            step = self.checkpointer.restore(None if self.resume is True else self.resume)
        if step is None:
            return  # nothing saved yet: a fresh start
        self.resumed_step = self._last_step = step
        log.info("PcframeCheckpoint: resumed from %s at step %d", self.dirpath, step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        step = trainer.global_step
        if self.checkpointer is None or step == self._last_step:
            return  # accumulating gradients: no optimizer step in this batch
        self._last_step = step
        metadata = {"epoch": trainer.current_epoch}
        try:
            handle = self.checkpointer.maybe_save(step, metadata)
            if handle is None and self.save_last and _last_step_of_fit(trainer):
                # Here, not at the end of fit: Lightning's restart logic resumes a version taken
                # in on_train_batch_end exactly; one taken after fit stopped resumes a fit loop
                # that counts one epoch more.
                self.checkpointer.save(step, metadata, reason="save_last")
        except SaveError as exc:
            # An earlier version failed in the background. The engine leaves the choice to the
            # loop; this callback stops the fit (as a failed ModelCheckpoint save does) rather
            # than train on without checkpoints, and says so.
            raise stopped_by(exc, "PcframeCheckpoint", step, False, AGAIN) from exc

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(clean=True, step=trainer.global_step)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Any exception leaving fit (KeyboardInterrupt too: Lightning calls this hook before
        # its sys.exit) releases the directory, so a next fit in this process can open it.
        self._close(clean=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(clean=True, step=trainer.global_step)

    def _close(self, clean: bool, step: int | None = None) -> None:
        """Close the Checkpointer (``clean=False``: after an exception, never raising over
        it). A close interrupted (a second Ctrl-C) keeps it, for the next fit to close."""
        checkpointer = self.checkpointer
        if checkpointer is None:
            return
        if not clean:  # as leaving a with block on an exception: no save_last, not a clean exit
            close_quietly(checkpointer, "PcframeCheckpoint")
            self.checkpointer = None
            return
        try:
            checkpointer.close()
        except SaveError as exc:  # closed all the same: a version of this fit failed
            self.checkpointer = None
            raise stopped_by(exc, "PcframeCheckpoint", step or 0, True, AGAIN) from exc
        self.checkpointer = None


def _last_step_of_fit(trainer: pl.Trainer) -> bool:
    """Whether fit stops after this batch (max_steps, max_epochs, or a callback's should_stop)."""
    if trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    return bool(
        trainer.is_last_batch
        and max_epochs is not None
        and max_epochs > 0
        and trainer.current_epoch + 1 >= max_epochs
    )


class _LightningSection(RestoredSection):
    """The ``lightning`` entry of a version: Lightning's checkpoint dict minus model/optimizer.

    ``capture`` runs on the training thread inside ``save()``; the engine encodes it at once,
    so later changes to the loops never leak into a version being written. ``apply`` runs
    inside ``Checkpointer.restore`` before the model, optimizer and RNG are loaded, each of
    its changes undone if anything of the version is refused (:class:`RestoredSection`).
    """

    def __init__(self, owner: PcframeCheckpoint) -> None:
        super().__init__()
        self.owner = owner
        self.trainer: pl.Trainer | None = None
        self.module: pl.LightningModule | None = None

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
            # What a mid-epoch position refers to, checked when it is resumed.
            DATA: {"train_data": [data_shape(dl) for dl in _flat(trainer.train_dataloader)]},
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
        changes = _data_changes(recorded, loaders) if isinstance(recorded, list) else []
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
            log.warning(
                "PcframeCheckpoint: the train data has changed since the version was saved "
                "(%s); it was saved at the end of an epoch, so the next epoch uses the new data",
                "; ".join(changes),
            )
        resumable = [dl for dl in loaders if isinstance(dl, _Stateful)]
        if positions and len(positions) != len(resumable):
            raise ValueError(
                f"the version holds the data positions of {len(positions)} train dataloaders "
                f"and this fit has {len(resumable)} with state_dict/load_state_dict: give the "
                "same train dataloaders, or start fresh (resume=False)"
            )
        # Loaded here, where a refusal (another sampler seed, say) can still be undone;
        # Lightning loads the same positions again when it sets up the data.
        for loader, position in zip(resumable, positions, strict=True):
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

    return _flat(_request_dataloader(source))


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


class _Schedulers:
    """Several schedulers as one stateful object (the engine saves one ``scheduler``)."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        return {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state) != len(self.schedulers):
            raise ValueError(
                f"the version holds {len(state)} schedulers, this trainer has "
                f"{len(self.schedulers)}: configure_optimizers must return the same ones"
            )
        for i, scheduler in enumerate(self.schedulers):
            scheduler.load_state_dict(state[str(i)])
