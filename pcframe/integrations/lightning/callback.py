"""The Lightning callback: one pcframe engine for the duration of ``fit``.

The engine is a :class:`pcframe.Checkpointer` in one process, and on every rank of a
multi-process fit (``strategy="ddp"``, or ``ModelParallelStrategy``: FSDP2 / DTensor) a
:class:`pcframe.distributed.DistributedCheckpointer` (:mod:`.processes`). It is made in
``on_fit_start``, the first hook where Lightning's strategy has built the optimizers and
schedulers (and the process group), and before Lightning itself would restore loops and
optimizers. The engine gets the LightningModule (DDP: its plain tensors are replicated, each
written once by one rank; FSDP2: its DTensors are sharded, each rank writing its shards), the
(one) optimizer, the schedulers and the ``lightning`` section (:mod:`.section`; several
processes: each rank its own). Saves happen in ``on_train_batch_end`` after each optimizer
step the policy picks (the same point as ``ModelCheckpoint(every_n_train_steps=...)``;
several processes: rank 0's policy decides for all), so Lightning's restart logic, written
for that point, resumes the loops; the engine's pre-hook on ``optimizer.step`` keeps the next
update from changing the weights before the snapshot is copied. A batch Lightning validates
after (``val_check_interval``, the end of an epoch) is saved at the end of that validation
(``on_validation_end``, where ``ModelCheckpoint(monitor=...)`` saves): a version taken before
it would resume with the RNG as it was before the validation, and Lightning's restart would
skip the validation, which had run only in the stopped process.

A resume is all or nothing: the ``lightning`` section is applied inside the engine's restore
and before the weights, each change with its undo; a refusal of any part leaves module,
optimizer, loops, callbacks, datamodule and RNG as they were (several processes: on every
rank, and a refusal of one rank's part alone stops every rank, :meth:`Processes.agree`).
"""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from pcframe.checkpointer import Checkpointer
from pcframe.errors import CheckpointError, PolicyError, SaveError
from pcframe.integrations._common import (
    DISTRIBUTED_ARGUMENTS,
    check_engine_options,
    check_flag,
    check_resume,
    close_quietly,
    policy_stopped,
    refused_resume,
    stopped_by,
)
from pcframe.integrations.lightning.messages import (
    AGAIN,
    DTYPE_FIX,
    OWNER,
    SECTION,
    error_line,
    n_processes,
    tell,
)
from pcframe.integrations.lightning.options import (
    OWN,
    REFUSED,
    EveryNEpochs,
    interval_policy,
    refused_strategy,
)
from pcframe.integrations.lightning.processes import Processes, several_processes
from pcframe.integrations.lightning.section import LightningSection
from pcframe.policies.base import IntervalPolicy


class PcframeCheckpoint(pl.callbacks.Checkpoint):
    """Save with pcframe under an interval policy; resume ``trainer.fit`` from the newest version.

    Args:
        dirpath: the checkpoint directory, as in ModelCheckpoint (one fit at a time; several
            processes: every rank writes ``dirpath/rank-<r>/``, on a shared file system or
            on each node's own disk).
        policy: a :mod:`pcframe.policies` interval policy or its registered name
            (``"young"``, ``"fixed_steps"``, ...); ``policy_options`` are its arguments.
        every_n_train_steps: ``policy=FixedSteps(n)`` (ModelCheckpoint's name; 0: no
            periodic saves). Nothing given: every 100 optimizer steps.
        every_n_epochs: a save after the last batch of every n-th epoch (ModelCheckpoint's
            name; 0: no periodic saves).
        train_time_interval: a ``datetime.timedelta``: a save when that much wall time has
            passed since the last one started (``policy=FixedTime(seconds)``).
            ``policy``, ``every_n_train_steps``, ``every_n_epochs`` and
            ``train_time_interval`` are mutually exclusive, as in ModelCheckpoint.
        save_last: save the step after which ``fit`` stops (``max_steps``, ``max_epochs`` or a
            callback's ``trainer.should_stop``) if the policy did not pick it (on by default,
            unlike ModelCheckpoint: a finished run should be resumable and exportable;
            ``"link"`` means ``True``: the newest version is always the last).
        resume: ``"auto"`` loads the newest valid version when ``fit`` starts (a corrupt one is
            quarantined and the previous tried), ``False`` starts fresh, an int loads that
            version (one process only). ``trainer.fit(ckpt_path=...)`` wins over ``"auto"``.
        verbose: one line per save started (Lightning's logger, rank 0). The resume, and
            every fallback to an older version, is always one WARNING line there.
        monitor, save_top_k: not supported (pcframe keeps the newest ``keep_last`` versions);
            add a ModelCheckpoint next to this callback for best-model files. ModelCheckpoint's
            other options without a meaning here (``filename``, ``mode``, ...) are refused,
            and so is any option that is none of these nor an engine option, when the
            callback is made.
        engine_options: :class:`pcframe.config.EngineConfig` fields, e.g. ``max_in_flight=2``,
            ``keep_last=3``; ``tiers``, ``placement``, ``notices``; for several processes
            also ``DistributedCheckpointer``'s (``keep_global``, ``protocol_timeout``,
            ``replicas``, ...; ignored in one process).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        *,
        policy: IntervalPolicy | str | None = None,
        policy_options: dict[str, Any] | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        train_time_interval: datetime.timedelta | None = None,
        save_last: bool | str = True,
        resume: bool | int | str = "auto",
        verbose: bool = False,
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
        if dirpath is None or (isinstance(dirpath, str) and not dirpath.strip()):
            raise ValueError("PcframeCheckpoint: dirpath= is required (the checkpoint directory)")
        if isinstance(dirpath, bytes) or not isinstance(dirpath, str | os.PathLike):
            raise TypeError(
                f"PcframeCheckpoint: dirpath={dirpath!r} is a {type(dirpath).__name__}: give "
                "the checkpoint directory as a str or a pathlib.Path"
            )
        check_engine_options(OWNER, engine_options, OWN, REFUSED)
        if save_last not in (True, False, "link"):
            raise ValueError(f"PcframeCheckpoint: save_last={save_last!r}: use True or False")
        self.dirpath = Path(dirpath)
        self.policy = interval_policy(
            policy, policy_options, every_n_train_steps, every_n_epochs, train_time_interval
        )
        self.save_last = bool(save_last)
        self.resume = check_resume(resume)
        self.verbose = check_flag(OWNER, "verbose", verbose)
        self.engine_options = engine_options
        self.checkpointer: Any = None  # a Checkpointer, or a DistributedCheckpointer
        self.resumed_step: int | None = None  # the step the last fit resumed from (None: fresh)
        self._section = LightningSection(self)
        self._last_step: int | None = None
        self._after_validation: tuple[int, dict[str, Any]] | None = None  # a save it waits for
        self._processes = Processes(self.dirpath, self._section)  # several processes
        self._unwrap: Any = _nothing  # puts Lightning's checkpoint loader back

    @property
    def state_key(self) -> str:
        return f"PcframeCheckpoint{{dirpath={str(self.dirpath)!r}}}"

    # --- lifecycle -------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            refusal = refused_strategy(trainer.strategy)
            if refusal:
                raise ValueError(refusal)
            twins = [
                c
                for c in trainer.callbacks
                if isinstance(c, PcframeCheckpoint)
                and c is not self
                and _same(c.dirpath, self.dirpath)
            ]
            if twins:  # the second one's open failed with advice for a notebook
                raise ValueError(
                    f"{OWNER}: two PcframeCheckpoint callbacks save to {self.dirpath}: one "
                    "writer per folder; give each its own dirpath (or keep one)"
                )
            self._refuse_ckpt_path_into(trainer)

    def _refuse_ckpt_path_into(self, trainer: pl.Trainer) -> None:
        """``trainer.fit(ckpt_path=<this dirpath or a version in it>)``, a Lightning user's
        first try at resuming, failed in Lightning's loader with a bare ``IsADirectoryError``;
        it is refused naming the fix (this callback resumes its folder by itself). Lightning
        loads ``ckpt_path`` after ``setup`` and before ``on_fit_start``: its loader is the only
        place to see it."""
        io = trainer.strategy.checkpoint_io
        load = io.load_checkpoint
        if getattr(load, "_pcframe_dirpath", None) == self.dirpath:
            return
        dirpath = self.dirpath

        def refusing(path: Any, *args: Any, **kwargs: Any) -> Any:
            # A folder only: a Lightning .ckpt file kept in dirpath (ModelCheckpoint's) loads.
            if (
                isinstance(path, str | os.PathLike)
                and Path(path).is_dir()
                and _inside(Path(path), dirpath)
            ):
                raise ValueError(
                    f"{OWNER}: trainer.fit(ckpt_path={str(path)!r}) names PcframeCheckpoint's "
                    f"own folder: it resumes {dirpath} by itself; drop ckpt_path (or give "
                    "PcframeCheckpoint(resume=<version>) for an older version)"
                )
            return load(path, *args, **kwargs)

        refusing._pcframe_dirpath = dirpath  # type: ignore[attr-defined]
        io.load_checkpoint = refusing

        def unwrap() -> None:  # at the end of the fit: trainer.test(ckpt_path=...) is not ours
            if io.__dict__.get("load_checkpoint") is refusing:
                del io.load_checkpoint

        self._unwrap = unwrap

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.checkpointer is not None or self._processes.group is not None:
            self._close(clean=False)  # an earlier fit ended without on_exception/teardown
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
            scheduler = Schedulers(schedulers)
        optimizer = optimizers[0] if optimizers else None
        self._section.bind(trainer, pl_module)
        self.resumed_step = None
        self._last_step = trainer.global_step
        self._after_validation = None
        # Not resuming from dirpath (resume=False, or a ckpt_path of Lightning's own) starts
        # over in it: the versions it holds are this fit's to prune (else its first save is
        # refused: the engine keeps what a run did not restore).
        options = {
            **self.engine_options,
            "take_over": self.resume is False or trainer.ckpt_path is not None,
        }
        if several_processes(trainer, pl_module, self.dirpath):
            self.checkpointer = self._processes.open(
                trainer,
                pl_module,
                optimizer,
                scheduler,
                self.policy,
                self.resume,
                options,
            )
        else:
            options = {k: v for k, v in options.items() if k not in DISTRIBUTED_ARGUMENTS}
            self.checkpointer = Checkpointer(
                self.dirpath,
                model=pl_module,
                optimizer=optimizer,
                scheduler=scheduler,
                stateful={SECTION: self._section},
                policy=self.policy,
                **options,
            )
        if self.resume is False:
            return
        if trainer.ckpt_path is not None:
            tell(
                trainer,
                logging.INFO,
                f"{OWNER}: trainer.fit(ckpt_path=...) given; not resuming from {self.dirpath}",
            )
            return
        # The section applies loops, callbacks, datamodule and data position inside the
        # restore, first of all objects: a refusal of any part (or of the model after it)
        # leaves model, optimizer, counters and RNG as they were (on_exception then closes).
        if self._processes.group is not None:
            step = self._processes.restore(self.checkpointer, trainer)
        else:
            try:
                with self._section.restoring():
                    step = self.checkpointer.restore(None if self.resume is True else self.resume)
            except CheckpointError as exc:  # the saved state does not fit: one line
                refused = refused_resume(OWNER, self.dirpath, exc, dtype_fix=DTYPE_FIX)
                if refused is not None:
                    raise refused from None
                raise
        self._tell_resumed(trainer, step)
        if step is not None:
            self.resumed_step = self._last_step = step

    def _tell_resumed(self, trainer: pl.Trainer, step: int | None) -> None:
        """One WARNING line on Lightning's logger (rank 0) for the resume and for each
        version it fell back from; an INFO line for a fresh start."""
        report = self.checkpointer.last_restore
        for version, why in report.skipped if report is not None else []:
            tell(
                trainer,
                logging.WARNING,
                f"{OWNER}: version {version} in {self.dirpath} "
                f"is damaged ({error_line(why)}); falling back to an older version",
            )
        for version, why in getattr(report, "lost", None) or []:
            tell(
                trainer,
                logging.WARNING,
                f"{OWNER}: version {version} in {self.dirpath} "
                f"cannot be gathered ({error_line(why)}); falling back to an older version",
            )
        if step is None:
            tell(
                trainer,
                logging.INFO,
                f"{OWNER}: no checkpoint in {self.dirpath} yet; training from the start",
            )
            return
        where = f"version {report.version}" if report is not None else "the newest version"
        saved = getattr(report, "saved_world_size", None)
        if saved is not None and saved != trainer.world_size:
            where += f", saved by {n_processes(saved)}, resharded to {trainer.world_size}"
        tell(
            trainer,
            logging.WARNING,
            f"{OWNER}: resumed from {self.dirpath} at step {step} ({where})",
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        step = trainer.global_step
        if self.checkpointer is None or step == self._last_step:
            return  # accumulating gradients: no optimizer step in this batch
        self._last_step = step
        metadata = {"epoch": trainer.current_epoch}
        if not _plateau_per_step(trainer) and _validates_next(trainer):
            # The policy is asked when the validation has run: a version taken now would hold
            # the RNG of before it (which a validation_step drawing, MC dropout or sampling,
            # moves on), and Lightning's restart skips the validation of the saved batch.
            self._after_validation = (step, metadata)
            return
        self._maybe_save(trainer, step, metadata)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        waiting, self._after_validation = self._after_validation, None
        if waiting is None or self.checkpointer is None or trainer.global_step != waiting[0]:
            return  # a validation after no step of this fit (sanity check, trainer.validate)
        self._maybe_save(trainer, *waiting)

    def _maybe_save(self, trainer: pl.Trainer, step: int, metadata: dict[str, Any]) -> None:
        """Ask the policy at ``step`` (every step once), and save the last step of ``fit``."""
        if isinstance(self.policy, EveryNEpochs):
            self.policy.due = self.policy.ends(trainer)
        try:
            handle = self.checkpointer.maybe_save(step, metadata)
            if handle is None and self.save_last and _last_step_of_fit(trainer):
                # Here, not at the end of fit: Lightning's restart logic resumes a version taken
                # in on_train_batch_end (or on_validation_end) exactly; one taken after fit
                # stopped resumes a fit loop that counts one epoch more.
                if self._processes.group is not None:  # collective: every rank stops at this step
                    handle = self.checkpointer.save(step, metadata)
                else:
                    handle = self.checkpointer.save(step, metadata, reason="save_last")
        except SaveError as exc:
            # An earlier version failed in the background. The engine leaves the choice to the
            # loop; this callback stops the fit (as a failed ModelCheckpoint save does) rather
            # than train on without checkpoints, and says so.
            raise stopped_by(exc, OWNER, step, False, AGAIN) from exc
        except PolicyError as exc:  # the interval or placement policy broke its contract
            raise policy_stopped(exc, OWNER, step, False, AGAIN) from exc
        if handle is not None and self.verbose:
            tell(
                trainer,
                logging.INFO,
                f"{OWNER}: saving step {step} as version {handle.version} in {self.dirpath}",
            )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(clean=True, step=trainer.global_step)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Any exception leaving fit (KeyboardInterrupt too: Lightning calls this hook before
        # its sys.exit) releases the directory, so a next fit in this process can open it.
        # A step that waited for its validation (which raised) is asked for first, as its
        # weights stand (a validation changes none), rather than lost; not on Ctrl-C.
        waiting, self._after_validation = self._after_validation, None
        if (
            waiting is not None
            and self.checkpointer is not None
            and isinstance(exception, Exception)
        ):
            try:
                self._maybe_save(trainer, *waiting)
            except Exception as exc:  # the exception on its way out is the one to see
                tell(
                    trainer,
                    logging.WARNING,
                    f"{OWNER}: step {waiting[0]}, due before the error, was not saved: "
                    f"{error_line(exc)}",
                )
        self._close(clean=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(clean=True, step=trainer.global_step)

    def _close(self, clean: bool, step: int | None = None) -> None:
        """Close the engine (``clean=False``: after an exception, never raising over it, and
        taking part in no collective). A close interrupted (a second Ctrl-C) keeps it, for
        the next fit to close."""
        self._unwrap()
        self._unwrap = _nothing
        checkpointer = self.checkpointer
        if checkpointer is None:
            self._processes.release()
            return
        if not clean:  # as leaving a with block on an exception: no save_last, not a clean exit
            close_quietly(checkpointer, OWNER)
            self.checkpointer = None
            self._processes.release()
            return
        try:
            checkpointer.close()
        except SaveError as exc:  # closed all the same: a version of this fit failed
            self.checkpointer = None
            self._processes.release()
            raise stopped_by(exc, OWNER, step or 0, True, AGAIN) from exc
        except PolicyError as exc:  # closed all the same: the placement failed at the end
            self.checkpointer = None
            self._processes.release()
            raise policy_stopped(exc, OWNER, step or 0, True, AGAIN) from exc
        except BaseException:
            self.checkpointer = None
            self._processes.release()
            raise
        self.checkpointer = None
        self._processes.release()


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


def _validates_next(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates after this batch, before the next one: the check its
    training epoch loop makes right after ``on_train_batch_end`` (``val_check_interval``, the
    end of an epoch, ``check_val_every_n_epoch``, an early stop), and validation data with
    batches to run (set up here if this is the fit's first validation, as the validation loop
    would a moment later), so that ``on_validation_end`` does follow.

    The check is Lightning's private ``_should_check_val_fx(data_fetcher)`` (as of 2.6). A
    Lightning without it (or without the loops' attributes read here), or whose check takes
    other arguments or answers other than a bool, gets no: the version is taken in
    ``on_train_batch_end``, before the validation, as before this deferral (the RNG of before
    it; never a lost or a failed save), and one WARNING line says so."""
    try:
        epoch_loop = trainer.fit_loop.epoch_loop
        validates = epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
        if not isinstance(validates, bool):
            raise TypeError(f"_should_check_val_fx answered a {type(validates).__name__}")
        validation = epoch_loop.val_loop
        if validates and validation._combined_loader is None:
            try:
                validation.setup_data()
            except Exception:  # the user's val_dataloader(): Lightning's own setup raises it
                return False  # next, this step saved first
        return validates and validation._combined_loader is not None and not validation.skip
    except Exception as exc:  # a Lightning of other internals: the save is not put off
        _cannot_tell(trainer, exc)
        return False


_TOLD: set[str] = set()  # the Lightning versions whose internals were found to differ


def _cannot_tell(trainer: pl.Trainer, error: Exception) -> None:
    if pl.__version__ in _TOLD:
        return
    _TOLD.add(pl.__version__)
    tell(
        trainer,
        logging.WARNING,
        f"{OWNER}: cannot tell whether Lightning {pl.__version__} validates after a batch "
        f"({type(error).__name__}: {error_line(error)}); a version at a validated step is "
        "taken before the validation (a resume from it draws from the RNG as it was before "
        "that validation)",
    )


def _plateau_per_step(trainer: pl.Trainer) -> bool:
    """Whether a ``ReduceLROnPlateau`` is stepped by the step: Lightning steps it after the
    validation, and its restart from a version taken at ``on_validation_end`` steps it once
    more, in a process without the metric it monitors (strict: the resumed fit fails). Such a
    fit is saved in ``on_train_batch_end`` (the scheduler one step behind, see Limits)."""
    return any(
        config.reduce_on_plateau and config.interval == "step"
        for config in trainer.lr_scheduler_configs
    )


class Schedulers:
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


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or anything in it (links resolved)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _nothing() -> None:
    pass
