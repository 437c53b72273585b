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
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from pcframe.integrations._common import check_resume, require_library, resolve_policy

pl = require_library("lightning.pytorch", "lightning", "lightning")

from pcframe.checkpointer import Checkpointer  # noqa: E402  (after the guard, on purpose)
from pcframe.policies.base import IntervalPolicy  # noqa: E402

log = logging.getLogger("pcframe")

__all__ = ["PcframeCheckpoint"]

SECTION = "lightning"  # the stateful name of Lightning's own state in every version


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
        version = None if self.resume is True else self.resume
        step = self.checkpointer.restore(version)
        if step is None:
            return  # nothing saved yet: a fresh start
        self._section.apply()
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
        handle = self.checkpointer.maybe_save(step, metadata)
        if handle is None and self.save_last and _last_step_of_fit(trainer):
            # Here, not at the end of fit: Lightning's restart logic resumes a version taken
            # in on_train_batch_end exactly; one taken after fit stopped resumes a fit loop
            # that counts one epoch more.
            self.checkpointer.save(step, metadata, reason="save_last")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(clean=True)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close(clean=False, error=exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(clean=True)

    def _close(self, clean: bool, error: BaseException | None = None) -> None:
        checkpointer, self.checkpointer = self.checkpointer, None
        if checkpointer is None:
            return
        if clean:
            checkpointer.close()
        else:  # as leaving a with block on an exception: no save_last, not a clean exit
            checkpointer.__exit__(type(error), error, None)


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


class _LightningSection:
    """The ``lightning`` entry of a version: Lightning's checkpoint dict minus model/optimizer.

    ``state_dict`` runs on the training thread inside ``save()``; the engine encodes it at once,
    so later changes to the loops never leak into a version being written.
    """

    def __init__(self, owner: PcframeCheckpoint) -> None:
        self.owner = owner
        self.trainer: pl.Trainer | None = None
        self.module: pl.LightningModule | None = None
        self.loaded: dict[str, Any] | None = None

    def bind(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.trainer, self.module, self.loaded = trainer, module, None

    def _others(self) -> list[pl.Callback]:
        assert self.trainer is not None
        return [cb for cb in self.trainer.callbacks if cb is not self.owner]

    def state_dict(self) -> dict[str, Any]:
        trainer, module = self.trainer, self.module
        assert trainer is not None and module is not None, "saved before on_fit_start"
        checkpoint: dict[str, Any] = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "pytorch-lightning_version": pl.__version__,
            "loops": {"fit_loop": trainer.fit_loop.state_dict()},
            "callbacks": {},
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Called inside Checkpointer.restore, after every check passed; applied by apply() once
        # model, optimizer and schedulers are loaded too.
        self.loaded = state

    def apply(self) -> None:
        trainer, module, state = self.trainer, self.module, self.loaded
        assert trainer is not None and module is not None
        if state is None:
            raise RuntimeError(f"the restored version has no '{SECTION}' section")
        module.on_load_checkpoint(state)  # as Lightning: the module's hook first
        trainer.fit_loop.load_state_dict(state["loops"]["fit_loop"])
        saved = state.get("callbacks", {})
        for callback in self._others():
            callback.on_load_checkpoint(trainer, module, state)
            if callback.state_key in saved:
                callback.load_state_dict(saved[callback.state_key])
        if "precision_plugin" in state:
            trainer.precision_plugin.load_state_dict(state["precision_plugin"])
        if trainer.datamodule is not None and "datamodule" in state:
            trainer.datamodule.load_state_dict(state["datamodule"])
        self.loaded = None


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
