"""``PcframeCallback``: pcframe's engine as a ``transformers.Trainer`` callback.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[PcframeCallback("ckpts")])
    trainer.train()        # resumes from the newest valid pcframe version

A callback cannot change the arguments of ``Trainer.train``, so the Trainer starts as a fresh
run and the callback turns it into the resumed one in ``on_train_begin`` (where optimizer,
scheduler and the prepared dataloader exist): model, optimizer, scheduler, RNGs and
``TrainerState`` are loaded, and the prepared dataloader is moved to the saved position: the
seedable sampler's seed is offset by the epochs already trained (the Trainer numbers its epochs
from 0 again), and the batches already trained in the interrupted epoch are skipped
(``DataLoaderShard.skip_batches``, as the Trainer's own resume does). The RNGs are set once
more right after the first batch is fetched, so the iterator's creation does not shift them,
and ``state.epoch`` is corrected at each step for the renumbered epochs. Saves happen in
``on_step_end``, after ``optimizer.step()``; the engine's pre-hook on the next step keeps the
weights unchanged until the snapshot is copied.

The TrainerState and the data position are applied inside ``Checkpointer.restore``, before the
weights, after the position is checked against the data it was saved in: a refusal of any
part changes nothing. Any exit of ``train()`` closes the Checkpointer (``_ClosingTrain``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

from pcframe.integrations._common import (
    RestoredSection,
    Undo,
    check_resume,
    close_quietly,
    data_shape,
    require_library,
    resolve_policy,
    shape_changes,
    stopped_by,
)

transformers = require_library("transformers", "transformers", "transformers")

import torch  # noqa: E402  (after the guard, on purpose)

from pcframe.checkpointer import Checkpointer  # noqa: E402
from pcframe.errors import SaveError  # noqa: E402
from pcframe.policies.base import IntervalPolicy  # noqa: E402
from pcframe.state.rng import capture_rng, restore_rng  # noqa: E402

log = logging.getLogger("pcframe")

__all__ = ["PcframeCallback"]

SECTION = "trainer_state"  # the stateful name of the TrainerState in every version
DATA = "pcframe_data"  # in that section, beside the TrainerState's fields: the data's shape
AGAIN = "run trainer.train() again"  # what resumes from the last committed version
NAME = "PcframeCallback"
# Set by this run's TrainingArguments (as the Trainer's own resume keeps them), not restored.
RUN_FIELDS = frozenset(
    {
        "max_steps",
        "num_train_epochs",
        "logging_steps",
        "eval_steps",
        "save_steps",
        "train_batch_size",
        "is_local_process_zero",
        "is_world_process_zero",
        "is_hyper_param_search",
    }
)


class PcframeCallback(transformers.TrainerCallback):
    """Save with pcframe on the policy's schedule; ``trainer.train()`` resumes the newest version.

    Args:
        output_dir: the checkpoint directory (one writer process at a time).
        policy: a :mod:`pcframe.policies` interval policy or its registered name;
            ``policy_options`` are its arguments.
        save_steps: shorthand for ``policy=FixedSteps(n)`` (the Trainer's name). Neither
            given: every 100 optimizer steps. Set the Trainer's own ``save_strategy="no"``.
        save_last: also save the step after which training stops, if the policy did not.
        resume: ``"auto"`` (newest valid version; a corrupt one is quarantined and the previous
            tried), ``False`` (fresh), or a version number.
        engine_options: :class:`pcframe.config.EngineConfig` fields (``max_in_flight=2``, ...).

    The Checkpointer is open from ``on_train_begin`` to ``on_train_end``. ``TrainerCallback``
    has no hook for an exception, so given to the Trainer's constructor the callback wraps
    that trainer's ``train`` (an instance attribute; ``del trainer.train`` removes it): any
    exit of ``train()``, KeyboardInterrupt included, closes the Checkpointer and releases the
    directory. A Checkpointer an earlier ``train()`` in this thread left open on the same
    directory (a callback added with ``add_callback``) is closed when the next one begins.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        *,
        policy: IntervalPolicy | str | None = None,
        policy_options: dict[str, Any] | None = None,
        save_steps: int | None = None,
        save_last: bool = True,
        resume: bool | int | str = "auto",
        **engine_options: Any,
    ) -> None:
        if output_dir is None or str(output_dir) == "":
            raise ValueError("PcframeCallback: output_dir= is required (the checkpoint directory)")
        self.output_dir = Path(output_dir)
        self.policy = resolve_policy(policy, save_steps, "save_steps", policy_options)
        self.save_last = save_last
        self.resume = check_resume(resume)
        self.engine_options = engine_options
        self.checkpointer: Checkpointer | None = None
        self.resumed_step: int | None = None  # the step the last train() resumed from
        self._position: _Position | None = None
        self._finalizer: weakref.finalize | None = None

    # --- lifecycle -------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _ClosingTrain.install(_calling_trainer(self), self)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if args.world_size > 1:
            raise RuntimeError(
                f"PcframeCallback runs in one process; this run has world_size={args.world_size}"
            )
        # Added after the Trainer was built (no on_init_end): wrap train() for later calls.
        _ClosingTrain.install(_calling_trainer(self), self)
        self._close_stale()
        optimizer = kwargs["optimizer"]
        dataloader = kwargs.get("train_dataloader")
        section = _TrainerStateSection(args, state, dataloader)
        checkpointer = Checkpointer(
            self.output_dir,
            model=kwargs["model"],
            # accelerate wraps the optimizer; the gate goes on the torch optimizer it steps
            optimizer=getattr(optimizer, "optimizer", optimizer),
            scheduler=kwargs.get("lr_scheduler"),
            stateful={SECTION: section},
            policy=self.policy,
            **self.engine_options,
        )
        self._hold(checkpointer)
        self.resumed_step, self._position = None, None
        try:
            self._resume(state, control, section)
        except BaseException:  # a refused resume: nothing was loaded; release the directory
            self._close(error=True)
            raise

    def _resume(self, state: Any, control: Any, section: _TrainerStateSection) -> None:
        if self.resume is False:
            return
        assert self.checkpointer is not None
        # The section applies the TrainerState and the data position inside the restore,
        # first of all objects: a refusal of any part leaves model, optimizer, scheduler,
        # TrainerState and RNG as they were.
        with section.restoring():
            step = self.checkpointer.restore(None if self.resume is True else self.resume)
        if step is None:
            return  # nothing saved yet: a fresh start
        self.resumed_step = step
        self._position = section.position
        if self._position is not None:
            self._position.restored()
        if state.global_step >= state.max_steps:
            # Finished already. The loop trains a batch before it looks at this flag, so the
            # position skips every batch too: an epoch without samples stops the Trainer.
            control.should_training_stop = True
            if self._position is not None:
                self._position.skip_all()
        log.info("PcframeCallback: resumed from %s at step %d", self.output_dir, step)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._position is not None:
            self._position.epoch_begins()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._position is not None:
            self._position.batch_fetched()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.checkpointer is None:
            return
        if self._position is not None:
            self._position.fix_epoch(state)
        step = state.global_step
        metadata = {"epoch": state.epoch}
        try:
            handle = self.checkpointer.maybe_save(step, metadata)
            last = control.should_training_stop or step >= state.max_steps
            if handle is None and self.save_last and last:
                self.checkpointer.save(step, metadata, reason="save_last")
        except SaveError as exc:
            # An earlier version failed in the background: the engine leaves the choice to
            # the loop; this callback stops training (as a failed save of the Trainer's own
            # does) rather than train on without checkpoints, and says so.
            raise stopped_by(exc, NAME, step, False, AGAIN) from exc

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close(error=False, step=state.global_step)

    # --- holding the directory -------------------------------------------------------------

    def _hold(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer
        _OPEN[_key(self.output_dir)] = _Opened(weakref.ref(self), threading.current_thread())
        # A callback dropped with its Checkpointer open (its Trainer gone) releases it.
        self._finalizer = weakref.finalize(self, close_quietly, checkpointer, NAME)
        self._finalizer.atexit = False  # the Checkpointer's own atexit closes it then

    def _close(self, error: bool, step: int | None = None) -> None:
        """Close the Checkpointer; ``error``: after an exception (never raises over it).
        A close interrupted (a second Ctrl-C) keeps it, for the next train() to close."""
        checkpointer = self.checkpointer
        if checkpointer is None:
            return
        if error:
            close_quietly(checkpointer, NAME)
            self._forget()
            return
        try:
            checkpointer.close()
        except SaveError as exc:  # closed all the same: a version of this run failed
            self._forget()
            raise stopped_by(exc, NAME, step or 0, True, AGAIN) from exc
        self._forget()

    def _forget(self) -> None:
        self.checkpointer = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        key = _key(self.output_dir)
        held = _OPEN.get(key)
        if held is not None and held.callback() is self:
            del _OPEN[key]

    def _close_stale(self) -> None:
        """Close what an earlier train() that ended by an exception left open here: this
        callback's Checkpointer, or another callback's on this directory from this thread
        (or a thread that has ended), as no train() of it can still be running."""
        if self.checkpointer is not None:
            log.warning("%s: closing the Checkpointer an earlier train() left open", NAME)
            self._close(error=True)
        held = _OPEN.get(_key(self.output_dir))
        other = held.callback() if held is not None else None
        if other is None or other is self or other.checkpointer is None:
            return
        assert held is not None
        if held.thread is threading.current_thread() or not held.thread.is_alive():
            log.warning(
                "%s: closing the Checkpointer of %s an earlier train() left open (it ended by "
                "an exception)",
                NAME,
                self.output_dir,
            )
            other._close(error=True)


@dataclasses.dataclass
class _Opened:
    callback: weakref.ReferenceType[PcframeCallback]
    thread: threading.Thread


_OPEN: dict[str, _Opened] = {}  # directory -> the callback holding it open in this process


def _key(directory: Path) -> str:
    return os.path.realpath(directory)


def _calling_trainer(callback: PcframeCallback) -> Any:
    """The Trainer whose callback handler is calling ``callback`` now (``None``: not found).

    A callback is not given its Trainer; the Trainer method that fires the event is on the
    stack, with the trainer as its ``self``.
    """
    frame = sys._getframe(2)
    for _ in range(32):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        handler = getattr(owner, "callback_handler", None)
        if any(cb is callback for cb in getattr(handler, "callbacks", ())) and callable(
            getattr(owner, "train", None)
        ):
            return owner
        frame = frame.f_back
    return None


class _ClosingTrain:
    """``trainer.train`` as it was, then: any exit by an exception closes the callback's
    Checkpointer (on a normal exit ``on_train_end`` has closed it)."""

    def __init__(self, train: Any, callback: PcframeCallback) -> None:
        functools.update_wrapper(self, train)
        self.callback = callback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.__wrapped__(*args, **kwargs)
        except BaseException:
            self.callback._close(error=True)
            raise

    @classmethod
    def install(cls, trainer: Any, callback: PcframeCallback) -> None:
        if trainer is None:
            return
        train = trainer.__dict__.get("train")
        while isinstance(train, _ClosingTrain):
            if train.callback is callback:
                return  # wrapped already
            train = train.__wrapped__
        trainer.train = cls(trainer.train, callback)


class _TrainerStateSection(RestoredSection):
    """The ``trainer_state`` entry of a version: the TrainerState's fields, as JSON, and the
    shape of the train data (what a mid-epoch position refers to)."""

    def __init__(self, args: Any, state: Any, dataloader: Any) -> None:
        super().__init__()
        self.args, self.state, self.dataloader = args, state, dataloader
        self.position: _Position | None = None  # applied by the last restore

    def capture(self) -> dict[str, Any]:
        saved = dataclasses.asdict(self.state)
        if self.dataloader is not None:
            offset = self.position.offset if self.position is not None else 0
            saved[DATA] = _shape(self.args, self.dataloader, offset)
        return saved

    def apply(self, saved: dict[str, Any], undo: Undo) -> None:
        step = saved.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"the saved TrainerState's global_step is {step!r}")
        # Checked before anything changes: the data position against the data now.
        position = _Position.plan(self.args, step, saved.get(DATA), self.dataloader)
        names = [f.name for f in dataclasses.fields(self.state)]
        before = {name: getattr(self.state, name) for name in names}  # replaced, not changed

        def put_back() -> None:
            for name, value in before.items():
                setattr(self.state, name, value)
            self.position = None

        undo.push(put_back)
        for name, value in saved.items():
            if name in names and name not in RUN_FIELDS:
                setattr(self.state, name, value)
        if position is not None:
            undo.push(position.apply())
        self.position = position


def _shape(args: Any, dataloader: Any, offset: int = 0) -> dict[str, Any]:
    """Samples and batches of an epoch, the accumulation, and the seed of the data order
    (``offset``: what a resume added to the sampler's seed, not part of it)."""
    seed = getattr(_sampler(dataloader), "initial_seed", None)
    return {
        **data_shape(dataloader),
        "accumulate": args.gradient_accumulation_steps,
        "seed": seed - offset if isinstance(seed, int) else None,
    }


@dataclasses.dataclass
class _Position:
    """Where in the data the resumed run is, and the Trainer's loop renumbered from epoch 0.

    The Trainer counts ``epoch`` and ``step`` from 0 in a run it believes fresh; ``offset`` is
    the true epoch of its epoch 0 and ``skipped`` the batches of that epoch trained before.
    """

    dataloader: Any
    offset: int
    skipped: int
    steps_in_epoch: int
    rng: dict[str, Any] | None = None  # the restored RNGs, set again after the first fetch
    local_epoch: int = -1

    @classmethod
    def plan(cls, args: Any, step: int, recorded: Any, dataloader: Any) -> _Position | None:
        """The position of saved ``step`` in ``dataloader``, changing nothing; refused (a
        ``ValueError``) where it is mid-epoch and the data is not the data it was saved in."""
        if dataloader is None:
            return None
        now = _shape(args, dataloader)
        batches = now["batches"]
        if batches is None:
            if step:
                log.warning(
                    "PcframeCallback: the train dataloader has no length; its position cannot "
                    "be restored and the resumed run reads the data from its beginning"
                )
            return None
        # Where the version stands, in the data it was saved in (an older version without
        # the record: the data now).
        saved = recorded if isinstance(recorded, dict) else now
        saved_batches = saved.get("batches") or batches
        saved_accumulate = saved.get("accumulate") or args.gradient_accumulation_steps
        per_epoch = max(math.ceil(saved_batches / saved_accumulate), 1)  # update steps
        offset, done = divmod(step, per_epoch)
        changes = shape_changes(saved, now)
        if changes and done:
            raise ValueError(
                f"the version was saved mid-epoch (step {step}: {done} of the {per_epoch} "
                f"steps of its epoch) and the train data has changed since "
                f"({'; '.join(changes)}): resuming would skip other samples than the ones "
                "trained. Resume with the same data, batch size and seed, from a version "
                "saved at the end of an epoch (resume=<version>), or start fresh (resume=False)"
            )
        if changes:
            log.warning(
                "PcframeCallback: the train data has changed since the version was saved (%s); "
                "it was saved at the end of an epoch, so the next epoch uses the new data",
                "; ".join(changes),
            )
        accumulate = args.gradient_accumulation_steps
        skipped = done * accumulate  # as the Trainer's resume
        if skipped and accumulate > 1 and batches % accumulate:
            log.warning(
                "PcframeCallback: gradient_accumulation_steps=%d does not divide the %d batches "
                "of an epoch; the rest of the interrupted epoch is not accumulated as before",
                accumulate,
                batches,
            )
        sampler = _sampler(dataloader)
        plain = isinstance(sampler, torch.utils.data.SequentialSampler | type(None))
        if offset and not hasattr(sampler, "initial_seed") and not plain:
            log.warning(
                "PcframeCallback: the sampler %s has no seed to offset; epochs after the resume "
                "are ordered as the Trainer's epoch 0, 1, ... (use accelerate's seedable sampler)",
                type(sampler).__name__,
            )
        return cls(dataloader, offset, skipped, batches)

    def apply(self) -> Any:
        """Move the dataloader to the position; returns the undo."""
        sampler = _sampler(self.dataloader)
        seeded = self.offset and hasattr(sampler, "initial_seed")
        seed, skip = getattr(sampler, "initial_seed", None), self.dataloader.skip_batches

        def undo() -> None:
            if seeded:
                sampler.initial_seed = seed
            self.dataloader.skip_batches = skip

        if seeded:
            sampler.initial_seed += self.offset  # seed = initial_seed + epoch: the true order
        if self.skipped:
            self.dataloader.skip_batches = self.skipped
        return undo

    def restored(self) -> None:
        """The restore is complete: keep the RNGs it set, to set them again after the first
        fetch (creating the iterator draws nothing the uninterrupted run did not)."""
        self.rng = capture_rng() if self.skipped else None

    def skip_all(self) -> None:
        self.dataloader.skip_batches = self.steps_in_epoch

    def epoch_begins(self) -> None:
        self.local_epoch += 1
        if self.local_epoch == 1 and self.skipped:
            self.dataloader.skip_batches = 0  # only the interrupted epoch is partly trained

    def batch_fetched(self) -> None:
        if self.rng is not None:
            restore_rng(self.rng)  # as saved, whatever creating the iterator drew
            self.rng = None

    def fix_epoch(self, state: Any) -> None:
        # The Trainer set state.epoch = local_epoch + (local_step + 1) / steps_in_epoch; write
        # the same expression with the true epoch and step, so the value is bit for bit equal.
        local = max(self.local_epoch, 0)
        done = round((state.epoch - local) * self.steps_in_epoch)
        if local == 0:
            done += self.skipped
        state.epoch = (self.offset + local) + done / self.steps_in_epoch


def _sampler(dataloader: Any) -> Any:
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    inner = getattr(batch_sampler, "batch_sampler", batch_sampler)  # a BatchSamplerShard
    return getattr(inner, "sampler", getattr(dataloader, "sampler", None))
