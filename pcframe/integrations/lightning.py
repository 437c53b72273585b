"""``PcframeCheckpoint``: pcframe's engine as a Lightning checkpoint callback.

    checkpoint = PcframeCheckpoint("ckpts-lightning", every_n_train_steps=50)  # or policy="young"
    trainer = L.Trainer(max_steps=1000, callbacks=[checkpoint])  # devices=4, strategy="ddp" too
    trainer.fit(model, train_dataloaders=loader)  # resumes from the newest valid version

The callback owns one engine for the duration of ``fit``: a :class:`pcframe.Checkpointer` in
one process, and on every rank of a multi-process fit (``strategy="ddp"``, or
``ModelParallelStrategy``: FSDP2 / DTensor) a
:class:`pcframe.distributed.DistributedCheckpointer`, whose collective methods the callback
calls on every rank at the same steps. It is made in ``on_fit_start``, the first hook where
Lightning's strategy has built the optimizers and schedulers (and the process group), and
before Lightning itself would restore loops and optimizers. The engine gets the
LightningModule (DDP: its plain tensors are replicated, each written once by one rank;
FSDP2: its DTensors are sharded, each rank writing its shards), the (one) optimizer, the
schedulers and a ``lightning`` section holding what Lightning's own checkpoints hold besides
tensors of the model: the fit loop's state (progress counters and the state of resumable
dataloaders), callbacks' states, precision plugin and datamodule state, and what
``on_save_checkpoint`` hooks add; several processes: each rank its own. Saves happen in
``on_train_batch_end`` after each optimizer step the policy picks (the same point as
``ModelCheckpoint(every_n_train_steps=...)``; several processes: rank 0's policy decides for
all), so Lightning's restart logic, written for that point, resumes the loops; the engine's
pre-hook on ``optimizer.step`` keeps the next update from changing the weights before the
snapshot is copied.

A resume is all or nothing: the ``lightning`` section applies Lightning's state, and the
train dataloaders' positions checked against the data they were saved in, inside the
engine's restore and before the weights, each change with its undo; a refusal of any part
leaves module, optimizer, loops, callbacks, datamodule and RNG as they were (several
processes: on every rank, when the ranks' refusal is the same; a refusal of one rank's part
alone stops every rank, see :meth:`PcframeCheckpoint._agree`). Another number of processes:
the global version is resharded (``DistributedCheckpointer``); ranks beyond the saved job get
saved rank 0's Lightning state, their data starting where a fresh loader starts; a version
saved mid-epoch is refused in one line (its epoch's samples were split among the old ranks).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pcframe.integrations._common import (
    DISTRIBUTED_ARGUMENTS,
    RestoredSection,
    Undo,
    another_model,
    check_engine_options,
    check_resume,
    close_quietly,
    data_shape,
    fits_another_model,
    length,
    require_library,
    resolve_policy,
    shape_changes,
    stopped_by,
)

pl = require_library("lightning.pytorch", "lightning", "lightning")

import torch.distributed as dist  # noqa: E402  (after the guard)
from lightning.fabric.utilities.types import _Stateful  # noqa: E402
from lightning.pytorch.loops import _Loop  # noqa: E402
from lightning.pytorch.loops.progress import _BaseProgress  # noqa: E402
from lightning.pytorch.utilities import CombinedLoader  # noqa: E402

from pcframe.checkpointer import Checkpointer  # noqa: E402
from pcframe.distributed import DistributedCheckpointer  # noqa: E402
from pcframe.distributed.global_versions import RECORDS, record_versions  # noqa: E402
from pcframe.errors import CheckpointError, SaveError  # noqa: E402
from pcframe.policies.base import Decision, IntervalPolicy, PolicyContext  # noqa: E402
from pcframe.policies.fixed_time import FixedTime  # noqa: E402
from pcframe.state.rng import capture_rng, restore_rng  # noqa: E402
from pcframe.store.directory import CheckpointDir  # noqa: E402

log = logging.getLogger("pcframe")
# What a default Lightning setup shows (its "lightning.pytorch" logger prints INFO and up).
say = logging.getLogger("lightning.pytorch.callbacks.pcframe")

__all__ = ["PcframeCheckpoint"]

OWNER = "PcframeCheckpoint"
SECTION = "lightning"  # the stateful name of Lightning's own state in every version
DATA = "pcframe"  # pcframe's entry in that section: the shape of the train data, per loader
AGAIN = "run trainer.fit(...) again"  # what resumes from the last committed version

# Its own arguments (offered as near matches of a misspelt option).
OWN = [
    "dirpath",
    "policy",
    "policy_options",
    "every_n_train_steps",
    "every_n_epochs",
    "train_time_interval",
    "save_last",
    "resume",
    "verbose",
]
# ModelCheckpoint's arguments that have no meaning here: refused when the callback is made.
REFUSED = {
    "filename": (
        "has no meaning here: pcframe numbers its versions (DIR/v00000012/); `pcframe export "
        "DIR --only model` writes the weights of one as a file"
    ),
    "mode": (
        "goes with monitor=, which PcframeCheckpoint does not take (it keeps the newest "
        "keep_last=N versions); add a ModelCheckpoint(monitor=..., mode=...) for best-model files"
    ),
    "save_weights_only": (
        "is not supported: a version holds the whole training state (optimizer, loops, RNG, "
        "data position) so that a resume is exact; `pcframe export DIR --only model` writes "
        "the weights alone"
    ),
    "auto_insert_metric_name": "has no meaning here: pcframe numbers its versions",
    "enable_version_counter": "has no meaning here: versions are numbered, never overwritten",
    "save_on_train_epoch_end": (
        "is not needed: saves happen after an optimizer step (on_train_batch_end); "
        "every_n_epochs=N saves after the last batch of every N-th epoch"
    ),
    "save_on_exception": (
        "is not supported: an exception stops training in the middle of a step; the newest "
        "committed version stays, and a preemption notice (notices=[SignalNoticeSource()] with "
        "policy=NoticeDriven(...)) saves a whole step"
    ),
}
# A restore's refusals that say the saved state does not fit this model (several processes).
_ANOTHER_MODEL = re.compile(
    r"^(rank \d+: )?global version \d+ (does not fit|has no|holds no|has optimizer state)"
)


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
        if dirpath is None or str(dirpath) == "":
            raise ValueError("PcframeCheckpoint: dirpath= is required (the checkpoint directory)")
        check_engine_options(OWNER, engine_options, OWN, REFUSED)
        if save_last not in (True, False, "link"):
            raise ValueError(f"PcframeCheckpoint: save_last={save_last!r}: use True or False")
        self.dirpath = Path(dirpath)
        self.policy = _interval_policy(
            policy, policy_options, every_n_train_steps, every_n_epochs, train_time_interval
        )
        self.save_last = bool(save_last)
        self.resume = check_resume(resume)
        self.verbose = bool(verbose)
        self.engine_options = engine_options
        self.checkpointer: Any = None  # a Checkpointer, or a DistributedCheckpointer
        self.resumed_step: int | None = None  # the step the last fit resumed from (None: fresh)
        self._section = _LightningSection(self)
        self._last_step: int | None = None
        self._group: Any = None  # several processes: a gloo group for the resume's agreement
        self._own_world = False  # one process resuming a multi-process version: our group

    @property
    def state_key(self) -> str:
        return f"PcframeCheckpoint{{dirpath={str(self.dirpath)!r}}}"

    # --- lifecycle -------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            refusal = _refused_strategy(trainer.strategy)
            if refusal:
                raise ValueError(refusal)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.checkpointer is not None or self._group is not None:
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
            scheduler = _Schedulers(schedulers)
        optimizer = optimizers[0] if optimizers else None
        self._section.bind(trainer, pl_module)
        self.resumed_step = None
        self._last_step = trainer.global_step
        if _several_processes(trainer, pl_module, self.dirpath):
            self._open_distributed(trainer, pl_module, optimizer, scheduler)
        else:
            options = {
                k: v for k, v in self.engine_options.items() if k not in DISTRIBUTED_ARGUMENTS
            }
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
            _say(
                trainer,
                logging.INFO,
                f"{OWNER}: trainer.fit(ckpt_path=...) given; not resuming from {self.dirpath}",
            )
            return
        # The section applies loops, callbacks, datamodule and data position inside the
        # restore, first of all objects: a refusal of any part (or of the model after it)
        # leaves model, optimizer, counters and RNG as they were (on_exception then closes).
        if self._group is not None:
            step = self._restore_distributed(trainer)
        else:
            try:
                with self._section.restoring():
                    step = self.checkpointer.restore(None if self.resume is True else self.resume)
            except CheckpointError as exc:
                if fits_another_model(exc):
                    raise another_model(OWNER, self.dirpath, exc) from None
                raise
        self._tell_resumed(trainer, step)
        if step is not None:
            self.resumed_step = self._last_step = step

    def _open_distributed(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, scheduler: Any
    ) -> None:
        """A DistributedCheckpointer on every rank (each of its methods is collective)."""
        if self.resume is not True and self.resume is not False:
            raise ValueError(
                f"PcframeCheckpoint: resume={self.resume}: a multi-process checkpoint resumes "
                "from its newest global version; use resume='auto' (or False)"
            )
        one_process = _one_process_versions(self.dirpath)
        if one_process:
            raise ValueError(
                f"PcframeCheckpoint: {self.dirpath} holds checkpoints of a one-process fit "
                f"(versions {one_process[0]}..{one_process[-1]}) and this fit runs "
                f"{trainer.world_size} processes: give it its own dirpath, or resume that one "
                "with devices=1"
            )
        if not dist.is_initialized():
            # One process resuming a multi-process checkpoint (another number of processes):
            # the engine's collectives run in a group of this process alone.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._own_world = True
        self._group = dist.new_group(backend="gloo")  # same order on every rank
        self.checkpointer = DistributedCheckpointer(
            self.dirpath,
            model=pl_module,
            optimizer=optimizer,
            scheduler=scheduler,
            stateful={SECTION: self._section},
            policy=self.policy,
            **self.engine_options,
        )

    def _restore_distributed(self, trainer: pl.Trainer) -> int | None:
        """``DistributedCheckpointer.restore`` on every rank, then :meth:`_agree`; ranks
        beyond the saved job's get saved rank 0's Lightning state (without data positions)."""
        step: int | None = None
        error: BaseException | None = None
        try:
            with self._section.restoring():
                step = self.checkpointer.restore()
        except Exception as exc:
            error = exc
        self._agree(error)
        report = self.checkpointer.last_restore
        saved = report.saved_world_size if report is not None else None
        if step is None or saved is None or saved >= trainer.world_size:
            return step
        # A grown job: ranks >= saved world size kept their own (fresh) per-rank state.
        sent = [self._section.applied if trainer.global_rank == 0 else None]
        dist.broadcast_object_list(sent, src=0, group=self._group)
        error = None
        if report.per_rank_state_from is None:
            try:
                self._section.apply_from_rank_zero(sent[0])
            except Exception as exc:
                error = exc
        self._agree(error)
        return step

    def _agree(self, error: BaseException | None) -> None:
        """Every rank learns whether the restore succeeded on every rank (one all-gather on
        the callback's gloo group), so a refusal on some ranks stops all of them, each
        saying why, instead of leaving the others to train into a collective it never
        joins. A rank that succeeded while another refused has loaded the version; it stops
        all the same (fit ends, its state is not used)."""
        mine = None if error is None else _first_line(self._reworded(error))
        outcomes: list[Any] = [None] * dist.get_world_size(self._group)
        try:
            dist.all_gather_object(outcomes, mine, group=self._group)
        except Exception:  # another rank is gone: the restore's own error says more
            if error is not None:
                raise self._reworded(error) from error
            raise
        if error is not None:
            raise self._reworded(error) from (None if fits_another_model(error) else error)
        refused = [(rank, why) for rank, why in enumerate(outcomes) if why is not None]
        if refused:
            rank, why = refused[0]
            raise CheckpointError(
                f"{OWNER}: rank {rank} refused the resume ({why}); every rank stops: fix it "
                f"and {AGAIN}"
            )

    def _reworded(self, error: BaseException) -> BaseException:
        if isinstance(error, CheckpointError) and (
            fits_another_model(error) or _ANOTHER_MODEL.match(str(error))
        ):
            return another_model(OWNER, self.dirpath, error)
        return error

    def _tell_resumed(self, trainer: pl.Trainer, step: int | None) -> None:
        """One WARNING line on Lightning's logger (rank 0) for the resume and for each
        version it fell back from; an INFO line for a fresh start."""
        report = self.checkpointer.last_restore
        for version, why in report.skipped if report is not None else []:
            _say(
                trainer,
                logging.WARNING,
                f"{OWNER}: version {version} in {self.dirpath} "
                f"is damaged ({_first_line(why)}); falling back to an older version",
            )
        for version, why in getattr(report, "lost", None) or []:
            _say(
                trainer,
                logging.WARNING,
                f"{OWNER}: version {version} in {self.dirpath} "
                f"cannot be gathered ({_first_line(why)}); falling back to an older version",
            )
        if step is None:
            _say(
                trainer,
                logging.INFO,
                f"{OWNER}: no checkpoint in {self.dirpath} yet; training from the start",
            )
            return
        where = f"version {report.version}" if report is not None else "the newest version"
        saved = getattr(report, "saved_world_size", None)
        if saved is not None and saved != trainer.world_size:
            where += f", saved by {saved} processes, resharded to {trainer.world_size}"
        _say(
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
        if isinstance(self.policy, _EveryNEpochs):
            self.policy.due = self.policy.ends(trainer)
        try:
            handle = self.checkpointer.maybe_save(step, metadata)
            if handle is None and self.save_last and _last_step_of_fit(trainer):
                # Here, not at the end of fit: Lightning's restart logic resumes a version taken
                # in on_train_batch_end exactly; one taken after fit stopped resumes a fit loop
                # that counts one epoch more.
                if self._group is not None:  # collective: every rank stops at this step
                    handle = self.checkpointer.save(step, metadata)
                else:
                    handle = self.checkpointer.save(step, metadata, reason="save_last")
        except SaveError as exc:
            # An earlier version failed in the background. The engine leaves the choice to the
            # loop; this callback stops the fit (as a failed ModelCheckpoint save does) rather
            # than train on without checkpoints, and says so.
            raise stopped_by(exc, OWNER, step, False, AGAIN) from exc
        if handle is not None and self.verbose:
            _say(
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
        self._close(clean=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(clean=True, step=trainer.global_step)

    def _close(self, clean: bool, step: int | None = None) -> None:
        """Close the engine (``clean=False``: after an exception, never raising over it, and
        taking part in no collective). A close interrupted (a second Ctrl-C) keeps it, for
        the next fit to close."""
        checkpointer = self.checkpointer
        if checkpointer is None:
            self._release_groups()
            return
        if not clean:  # as leaving a with block on an exception: no save_last, not a clean exit
            close_quietly(checkpointer, OWNER)
            self.checkpointer = None
            self._release_groups()
            return
        try:
            checkpointer.close()
        except SaveError as exc:  # closed all the same: a version of this fit failed
            self.checkpointer = None
            self._release_groups()
            raise stopped_by(exc, OWNER, step or 0, True, AGAIN) from exc
        except BaseException:
            self.checkpointer = None
            self._release_groups()
            raise
        self.checkpointer = None
        self._release_groups()

    def _release_groups(self) -> None:
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
        if self._own_world:
            self._own_world = False
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()


def _say(trainer: pl.Trainer, level: int, message: str) -> None:
    """A line on Lightning's own logger, from rank 0 only (every rank restores the same)."""
    if trainer.is_global_zero:
        say.log(level, message)


def _first_line(error: Any) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _interval_policy(
    policy: IntervalPolicy | str | None,
    options: dict[str, Any] | None,
    every_n_train_steps: int | None,
    every_n_epochs: int | None,
    train_time_interval: datetime.timedelta | None,
) -> IntervalPolicy:
    """The policy from ``policy=`` or one of Lightning's three spellings of an interval."""
    lightning = {
        "every_n_epochs": every_n_epochs,
        "train_time_interval": train_time_interval,
    }
    given = [name for name, value in lightning.items() if value is not None]
    others = [
        n
        for n, v in (("policy", policy), ("every_n_train_steps", every_n_train_steps))
        if v is not None
    ]
    if given and (others or len(given) > 1):
        raise ValueError(
            f"PcframeCheckpoint: {' and '.join(others + given)} given: give one of policy=, "
            "every_n_train_steps=, every_n_epochs=, train_time_interval= (as in "
            "ModelCheckpoint, they are mutually exclusive)"
        )
    if every_n_epochs is not None:
        if (
            isinstance(every_n_epochs, bool)
            or not isinstance(every_n_epochs, int)
            or (every_n_epochs < 0)
        ):
            raise ValueError(
                f"PcframeCheckpoint: every_n_epochs={every_n_epochs!r}: a whole number of "
                "epochs >= 1 (0: no periodic saves)"
            )
        return _EveryNEpochs(every_n_epochs)
    if train_time_interval is not None:
        if not isinstance(train_time_interval, datetime.timedelta) or (
            train_time_interval.total_seconds() <= 0
        ):
            raise ValueError(
                f"PcframeCheckpoint: train_time_interval={train_time_interval!r}: give a "
                "positive datetime.timedelta, e.g. timedelta(minutes=30)"
            )
        return FixedTime(seconds=train_time_interval.total_seconds())
    if every_n_train_steps == 0 and policy is None:  # ModelCheckpoint's "never"
        return _EveryNEpochs(0)
    return resolve_policy(policy, every_n_train_steps, "every_n_train_steps", options)


class _EveryNEpochs(IntervalPolicy):
    """A save after the last batch of every n-th epoch (``every_n_epochs``; 0: never).

    The callback says whether this step ends such an epoch (``due``) just before it asks the
    engine; the engine's notices (emergencies) still work as with any policy.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.due = False

    def ends(self, trainer: pl.Trainer) -> bool:
        return bool(
            self.every and trainer.is_last_batch and (trainer.current_epoch + 1) % self.every == 0
        )

    def decide(self, ctx: PolicyContext) -> Decision:
        if self.due:
            return Decision(True, f"the end of an epoch (every_n_epochs={self.every})")
        return Decision(False)

    def state_dict(self) -> dict[str, Any]:
        return {"every_n_epochs": self.every}


def _refused_strategy(strategy: Any) -> str | None:
    """The line refusing a strategy whose model state this callback cannot save."""
    names = {cls.__name__ for cls in type(strategy).__mro__}
    if "FSDPStrategy" in names:
        return (
            "PcframeCheckpoint does not save Lightning's FSDPStrategy (FSDP1: its flat "
            "parameters are not DTensors): use ModelParallelStrategy with fully_shard in "
            "configure_model (FSDP2), or strategy='ddp'"
        )
    if "DeepSpeedStrategy" in names:
        return (
            "PcframeCheckpoint does not save DeepSpeedStrategy (DeepSpeed partitions the "
            "optimizer state itself): use ModelParallelStrategy (FSDP2) or strategy='ddp', "
            "or DeepSpeed's own checkpoints"
        )
    return None


def _several_processes(trainer: pl.Trainer, module: pl.LightningModule, dirpath: Path) -> bool:
    """Whether this fit checkpoints through DistributedCheckpointer: several processes, a
    directory of a multi-process fit (resumed by another number of them), or DTensor
    parameters (ModelParallelStrategy, even on one device)."""
    if trainer.world_size > 1 or _multi_process_layout(dirpath):
        return True
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _multi_process_layout(dirpath: Path) -> bool:
    return (dirpath / RECORDS).is_dir() and bool(record_versions(dirpath))


def _one_process_versions(dirpath: Path) -> list[int]:
    """Committed versions of a one-process Checkpointer at the top of ``dirpath``."""
    if not dirpath.is_dir() or _multi_process_layout(dirpath):
        return []
    try:
        return CheckpointDir(dirpath).committed_versions()
    except (OSError, CheckpointError):
        return []


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
                f"epoch) by {saved_world} processes and this fit runs {trainer.world_size}: "
                "the rest of that epoch was split among the old processes. Resume with "
                f"{saved_world} processes, or from a version saved at the end of an epoch "
                "(every_n_epochs=N), or start fresh (resume=False)"
            )
        changes = _data_changes(recorded, loaders) if isinstance(recorded, list) else []
        if saved_world != trainer.world_size:
            changes = [f"{c} ({saved_world} processes -> {trainer.world_size})" for c in changes]
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
            _say(
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
