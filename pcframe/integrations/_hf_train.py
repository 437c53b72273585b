"""How ``PcframeCallback`` reaches the ``Trainer`` it is given to: the trainer is found on the
stack when the callback handler calls it, and its ``train`` is wrapped (an attribute of the
instance) so that any exit of ``train()`` closes the callback's engine and
``resume_from_checkpoint`` means what a Trainer user means by it (the callback decides).

``TrainerCallback`` has no hook for an exception and the Trainer reads
``resume_from_checkpoint`` before any callback runs; the wrapper is the one place for both.
"""

from __future__ import annotations

import functools
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
