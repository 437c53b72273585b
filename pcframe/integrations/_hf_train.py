"""How ``PcframeCallback`` reaches the ``Trainer`` it is given to: the trainer is found on the
stack when the callback handler calls it, and its ``train`` is wrapped (an attribute of the
instance) so that any exit of ``train()`` closes the callback's engine and
``resume_from_checkpoint`` means what a Trainer user means by it (the callback decides).

``TrainerCallback`` has no hook for an exception and the Trainer reads
``resume_from_checkpoint`` before any callback runs; the wrapper is the one place for both.

A run resumed mid-epoch has the first epoch's ``_run_epoch`` wrapped too (:class:`ResumedEpoch`,
for that one call): the Trainer, which believes the run fresh, numbers the batches of an epoch
from its first one, and only the arguments of that call tell it where the saved run stood.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any


def calling_trainer(callback: Any) -> Any:
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


class ClosingTrain:
    """``trainer.train`` as it was, with ``resume_from_checkpoint`` as the callback reads it;
    then: any exit by an exception closes the callback's engine (on a normal exit
    ``on_train_end`` has closed it)."""

    def __init__(self, train: Any, callback: Any) -> None:
        functools.update_wrapper(self, train)
        self.callback = callback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.callback._resume_argument(args, kwargs)  # refused before training
        try:
            return self.__wrapped__(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, Exception):  # not Ctrl-C: the step due before it is saved
                self.callback._save_left_over()
            self.callback._close(error=True)
            raise
        finally:
            self.callback._asked = False

    @classmethod
    def install(cls, trainer: Any, callback: Any) -> None:
        if trainer is None:
            return
        train = trainer.__dict__.get("train")
        while isinstance(train, ClosingTrain):
            if train.callback is callback:
                return  # wrapped already
            train = train.__wrapped__
        trainer.train = cls(trainer.train, callback)


class ResumedEpoch:
    """``trainer._run_epoch`` for the first epoch of a run resumed mid-epoch: that call gets the
    arguments of the Trainer's own resume (``resume_from_checkpoint`` and
    ``steps_trained_in_current_epoch``, the batches of the interrupted epoch trained before),
    so the Trainer skips those batches (``get_resumed_dataloader``) and numbers the rest from
    where the saved run stood: the same accumulation windows, the epoch's last, shorter one
    included, and the same optimizer steps as an uninterrupted run.

    Numbered from the epoch's first batch instead, the Trainer ends an accumulation window
    every ``gradient_accumulation_steps`` batches of what is left and at the epoch's last batch
    counted from the full epoch, which it never reaches: where the accumulation does not divide
    the epoch's batches, the gradient of the last, shorter window went into the next epoch's
    first optimizer step.

    An attribute of the instance for one call: it removes itself when called, and acts only in
    the ``train()`` it was installed in (the same ``TrainerState``).
    """

    # What the call takes for the Trainer's resume of an epoch (transformers since _run_epoch
    # was split out of _inner_training_loop, 2026).
    SKIPPED = "steps_trained_in_current_epoch"
    NEEDS = frozenset({"epoch", "epochs_trained", "resume_from_checkpoint", SKIPPED})

    def __init__(self, trainer: Any, skipped: int, checkpoint: str) -> None:
        run_epoch = trainer._run_epoch
        functools.update_wrapper(self, run_epoch)
        # The instance's own _run_epoch (a user's or a profiler's patch), put back on removal.
        self.own = trainer.__dict__.get("_run_epoch")
        self.trainer, self.skipped, self.checkpoint = trainer, skipped, checkpoint
        self.state = trainer.state  # the train() this resume belongs to
        self.signature = inspect.signature(run_epoch)

    @classmethod
    def unfit(cls, trainer: Any) -> str | None:
        """Why ``trainer`` cannot be told where its first epoch stands (``None``: it can): it
        takes the position as arguments of ``_run_epoch`` (older transformers run the epoch
        inside ``_inner_training_loop``), and skips nothing with ``ignore_data_skip=True``."""
        if trainer is None:
            return "the Trainer calling the callback was not found"
        if getattr(getattr(trainer, "args", None), "ignore_data_skip", False):
            return "ignore_data_skip=True"
        try:
            names = set(inspect.signature(trainer._run_epoch).parameters)
        except (AttributeError, TypeError, ValueError):  # none, or not a plain callable
            names = set()
        if cls.NEEDS - names:
            return "an older transformers, whose Trainer has no _run_epoch taking it"
        return None

    @classmethod
    def install(cls, trainer: Any, skipped: int, checkpoint: str) -> None:
        cls.remove(trainer)
        trainer._run_epoch = cls(trainer, skipped, checkpoint)

    @classmethod
    def remove(cls, trainer: Any) -> None:
        """Remove the wrapper (one left by a ``train()`` that ended before its first epoch,
        too), putting back what the instance had before it."""
        wrapper = trainer.__dict__.get("_run_epoch") if trainer is not None else None
        if isinstance(wrapper, cls):
            if wrapper.own is None:
                del trainer._run_epoch
            else:
                trainer._run_epoch = wrapper.own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.remove(self.trainer)  # this epoch only
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        first = given["epoch"] == given["epochs_trained"]
        if self.trainer.state is not self.state or not first or given["resume_from_checkpoint"]:
            return self.__wrapped__(*args, **kwargs)  # not the resumed epoch
        given["resume_from_checkpoint"] = self.checkpoint  # it reads no file there (below)
        given[self.SKIPPED] = self.skipped
        # The Trainer sets the RNGs of its checkpoint after the first fetch; pcframe's restore
        # sets them then (PcframeCallback.on_step_begin), and the folder has no file of them.
        own = self.trainer.__dict__.get("_load_rng_state")
        self.trainer._load_rng_state = _rngs_set_by_pcframe
        try:
            return self.__wrapped__(*bound.args, **bound.kwargs)
        finally:
            if own is None:
                del self.trainer._load_rng_state
            else:
                self.trainer._load_rng_state = own


def _rngs_set_by_pcframe(checkpoint: Any) -> None:
    """The Trainer's ``_load_rng_state`` during the resumed epoch: nothing to load."""
