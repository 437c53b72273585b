"""The Lightning callback's arguments: Lightning's spellings of an interval (``every_n_epochs``,
``train_time_interval``) as interval policies, ModelCheckpoint's options that mean nothing
here (refused when the callback is made), and the strategies whose state it cannot save."""

from __future__ import annotations

import datetime
from typing import Any

import lightning.pytorch as pl

from pcframe.integrations._common import resolve_policy
from pcframe.policies.base import Decision, IntervalPolicy, PolicyContext
from pcframe.policies.fixed_time import FixedTime

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


def interval_policy(
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
    for name, count in (
        ("every_n_train_steps", every_n_train_steps),
        ("every_n_epochs", every_n_epochs),
    ):
        if count is not None and (
            isinstance(count, bool) or not isinstance(count, int) or count < 0
        ):
            unit = "steps" if name == "every_n_train_steps" else "epochs"
            raise ValueError(
                f"PcframeCheckpoint: {name}={count!r}: a whole number of {unit} >= 1 "
                "(0: no periodic saves)"
            )
    if every_n_epochs is not None:
        return EveryNEpochs(every_n_epochs)
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
        return EveryNEpochs(0)
    return resolve_policy(policy, every_n_train_steps, "every_n_train_steps", options)


class EveryNEpochs(IntervalPolicy):
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


def refused_strategy(strategy: Any) -> str | None:
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
