"""The Hugging Face Trainer's own state in a pcframe version: the ``trainer_state`` section
(the ``TrainerState`` fields and the shape of the train data) and the data position a resume
moves the prepared dataloader to.

The Trainer counts ``epoch`` and ``step`` from 0 in a run it believes fresh; a resume tells
its dataloader where the saved run stood (the seedable sampler's seed offset by the epochs
trained), has the Trainer skip the batches of the interrupted epoch trained before and number
the rest from there (the first epoch's ``_run_epoch`` gets the arguments of the Trainer's own
resume: :class:`pcframe.integrations._hf_train.ResumedEpoch`), and rewrites ``state.epoch``
with the true epoch at each step. Warnings go through ``warn``, so a job of several processes
says each once (rank 0).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import torch

from pcframe.errors import StateMismatch
from pcframe.integrations._common import RestoredSection, Undo, data_shape, shape_changes
from pcframe.state.rng import capture_rng, restore_rng

SECTION = "trainer_state"  # the stateful name of the TrainerState in every version
DATA = "pcframe_data"  # in that section, beside the TrainerState's fields: the data's shape
PROCESSES = "processes"  # in DATA: the job's number of processes
# In the section too: the TrainingArguments that make the LR schedule the Trainer builds.
SCHEDULE = "pcframe_schedule"
# (warmup_steps is a ratio below 1; the number of training steps is this run's max_steps,
# which a longer resumed run changes on purpose, as the Trainer's own resume allows)
SCHEDULE_ARGS = ("lr_scheduler_type", "warmup_steps", "warmup_ratio", "lr_scheduler_kwargs")
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

Warn = Callable[..., None]  # logging-style: a format string and its arguments


class TrainerStateSection(RestoredSection):
    """The ``trainer_state`` entry of a version: the TrainerState's fields, as JSON, and the
    shape of the train data (what a mid-epoch position refers to)."""

    def __init__(
        self,
        args: Any,
        state: Any,
        dataloader: Any,
        warn: Warn,
        *,
        untold: str | None,
        schedule: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.args, self.state, self.dataloader, self.warn = args, state, dataloader, warn
        # The settings of the LR schedule the Trainer built (:func:`schedule_of`); None: the
        # scheduler is the user's own (``optimizers=``), which the arguments do not make.
        self.schedule = schedule
        # Why the Trainer cannot be told where its resumed epoch stands (ResumedEpoch.unfit);
        # None: it is, and skips the batches trained itself.
        self.untold = untold
        self.position: Position | None = None  # applied by the last restore
        self.applied: dict[str, Any] | None = None  # the saved section the last restore applied

    def capture(self) -> dict[str, Any]:
        saved = dataclasses.asdict(self.state)
        if self.dataloader is not None:
            offset = self.position.offset if self.position is not None else 0
            # The processes beside the shape, to word a refusal (the position itself is the
            # same for another number of processes with the same batches an epoch).
            recorded = shape(self.args, self.dataloader, offset)
            saved[DATA] = {**recorded, PROCESSES: processes(self.args)}
        if self.schedule is not None:
            saved[SCHEDULE] = dict(self.schedule)
        return saved

    def apply(self, saved: dict[str, Any], undo: Undo) -> None:
        step = saved.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"the saved TrainerState's global_step is {step!r}")
        # Checked before anything changes: the schedule against this run's.
        refuse_other_schedule(saved.get(SCHEDULE), self.schedule)
        # Checked before anything changes: the data position against the data now.
        position = Position.plan(
            self.args, step, saved.get(DATA), self.dataloader, self.warn, self.untold
        )
        names = [f.name for f in dataclasses.fields(self.state)]
        before = {name: getattr(self.state, name) for name in names}  # replaced, not changed

        def put_back() -> None:
            for name, value in before.items():
                setattr(self.state, name, value)
            self.position, self.applied = None, None

        undo.push(put_back)
        for name, value in saved.items():
            if name in names and name not in RUN_FIELDS:
                setattr(self.state, name, value)
        if position is not None:
            undo.push(position.apply())
        self.position, self.applied = position, saved


def schedule_of(args: Any, trainer: Any) -> dict[str, Any] | None:
    """The TrainingArguments that make the LR schedule (:data:`SCHEDULE_ARGS`), as plain
    values; ``None`` where ``trainer`` did not build its scheduler (one given through
    ``optimizers=``: the arguments do not make it). A ``trainer`` of ``None`` (not found):
    taken to have built it, as it does unless given one."""
    if trainer is not None and getattr(trainer, "_created_lr_scheduler", True) is False:
        return None
    settings: dict[str, Any] = {}
    for name in SCHEDULE_ARGS:
        if not hasattr(args, name):  # an argument this transformers version does not have
            continue
        value = getattr(args, name)
        value = getattr(value, "value", value)  # SchedulerType("linear") -> "linear"
        if name == "lr_scheduler_kwargs":  # a dict (or a JSON string) or None: its text
            value = json.dumps(value or {}, sort_keys=True, default=str)
        elif not isinstance(value, int | float | str | None) or isinstance(value, bool):
            value = str(value)
        settings[name] = value
    return settings


def refuse_other_schedule(saved: Any, now: dict[str, Any] | None) -> None:
    """Raise a :class:`~pcframe.errors.StateMismatch` when the saved run's LR schedule was
    made by other TrainingArguments than this run's: every Trainer schedule is a LambdaLR,
    so the engine's class check passes, and the resumed run's lambda (cosine, say) would
    carry on from the saved run's step and last LR (linear), silently. Nothing to compare
    for a version saved before the settings were recorded, or a scheduler of the user's."""
    if not isinstance(saved, dict) or now is None:
        return
    mismatches = []
    for name in SCHEDULE_ARGS:
        if name in saved and name in now and saved[name] != now[name]:
            was, has = saved[name], now[name]
            if name == "lr_scheduler_kwargs":  # shown as the dicts they are
                was, has = _loaded(was), _loaded(has)
            mismatches.append(
                f"scheduler: saved with TrainingArguments {name}={was!r}, this run has {has!r}"
            )
    if mismatches:
        raise StateMismatch(
            "the saved LR schedule is not this run's: " + "; ".join(mismatches), mismatches
        )


def _loaded(text: Any) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def shape(args: Any, dataloader: Any, offset: int = 0) -> dict[str, Any]:
    """Samples and batches of an epoch, the accumulation, and the seed of the data order
    (``offset``: what a resume added to the sampler's seed, not part of it)."""
    seed = getattr(sampler_of(dataloader), "initial_seed", None)
    return {
        **data_shape(dataloader),
        "accumulate": args.gradient_accumulation_steps,
        "seed": seed - offset if isinstance(seed, int) else None,
    }


@dataclasses.dataclass
class Position:
    """Where in the data the resumed run is, and the Trainer's loop renumbered from epoch 0.

    The Trainer counts ``epoch`` and ``step`` from 0 in a run it believes fresh; ``offset`` is
    the true epoch of its epoch 0 and ``skipped`` the batches of that epoch trained before.
    ``trainer_skips``: the Trainer skips them and numbers that epoch's batches from there (its
    first ``_run_epoch`` is given them); otherwise the dataloader skips them (``skip_batches``)
    and the Trainer numbers what is left from 0, which ends the accumulation windows where an
    uninterrupted run does only when ``gradient_accumulation_steps`` divides the batches of an
    epoch.
    """

    dataloader: Any
    offset: int
    skipped: int
    steps_in_epoch: int
    trainer_skips: bool = False
    rng: dict[str, Any] | None = None  # the restored RNGs, set again after the first fetch
    local_epoch: int = -1

    @classmethod
    def plan(
        cls,
        args: Any,
        step: int,
        recorded: Any,
        dataloader: Any,
        warn: Warn,
        untold: str | None,
    ) -> Position | None:
        """The position of saved ``step`` in ``dataloader``, changing nothing; refused (a
        ``ValueError``) where it is mid-epoch and the data is not the data it was saved in.
        ``untold``: why the Trainer cannot be told where its first epoch stands (``None``: it
        is, and skips the batches trained itself)."""
        if dataloader is None:
            return None
        now = shape(args, dataloader)
        batches = now["batches"]
        if batches is None:
            if step:
                warn(
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
            was, now_processes = saved.get(PROCESSES), processes(args)
            if isinstance(was, int) and was != now_processes:
                changes.append(
                    f"saved by {was} processes, this job has {now_processes}: keep "
                    "per_device_train_batch_size x processes the same"
                )
            raise ValueError(
                f"the version was saved mid-epoch (step {step}: {done} of the {per_epoch} "
                f"steps of its epoch) and the train data has changed since "
                f"({'; '.join(changes)}): resuming would skip other samples than the ones "
                "trained. Resume with the same data, batch size and seed, from a version "
                "saved at the end of an epoch (resume=<version>), or start fresh (resume=False)"
            )
        if changes:
            warn(
                "PcframeCallback: the train data has changed since the version was saved (%s); "
                "it was saved at the end of an epoch, so the next epoch uses the new data",
                "; ".join(changes),
            )
        accumulate = args.gradient_accumulation_steps
        skipped = done * accumulate  # as the Trainer's resume
        if skipped and untold is not None and accumulate > 1 and batches % accumulate:
            warn(
                "PcframeCallback: gradient_accumulation_steps=%d does not divide the %d batches "
                "of an epoch, and the Trainer cannot be told where in its epoch the resume "
                "stands (%s): the epoch's last, shorter accumulation window is accumulated "
                "into the next epoch's first optimizer step, and every later step trains on "
                "other batches than an uninterrupted run would (choose "
                "gradient_accumulation_steps dividing the epoch's batches to resume exactly)",
                accumulate,
                batches,
                untold,
            )
        sampler = sampler_of(dataloader)
        plain = isinstance(sampler, torch.utils.data.SequentialSampler | type(None))
        if offset and not hasattr(sampler, "initial_seed") and not plain:
            warn(
                "PcframeCallback: the sampler %s has no seed to offset; epochs after the resume "
                "are ordered as the Trainer's epoch 0, 1, ... (use accelerate's seedable sampler)",
                type(sampler).__name__,
            )
        return cls(dataloader, offset, skipped, batches, untold is None and skipped > 0)

    def apply(self) -> Any:
        """Move the dataloader to the position; returns the undo."""
        sampler = sampler_of(self.dataloader)
        seeded = self.offset and hasattr(sampler, "initial_seed")
        seed, skip = getattr(sampler, "initial_seed", None), self.dataloader.skip_batches

        def undo() -> None:
            if seeded:
                sampler.initial_seed = seed
            self.dataloader.skip_batches = skip

        if seeded:
            sampler.initial_seed += self.offset  # seed = initial_seed + epoch: the true order
        if self.skipped and not self.trainer_skips:
            self.dataloader.skip_batches = self.skipped
        return undo

    def restored(self) -> None:
        """The restore is complete: keep the RNGs it set, to set them again after the first
        fetch (creating the iterator draws nothing the uninterrupted run did not)."""
        self.rng = capture_rng() if self.skipped else None

    def skip_all(self) -> None:
        self.dataloader.skip_batches = self.steps_in_epoch
        self.trainer_skips = False  # the dataloader skips, not the Trainer

    def epoch_begins(self) -> None:
        self.local_epoch += 1
        if self.local_epoch == 1 and self.skipped and not self.trainer_skips:
            self.dataloader.skip_batches = 0  # only the interrupted epoch is partly trained

    def batch_fetched(self) -> None:
        if self.rng is not None:
            restore_rng(self.rng)  # as saved, whatever creating the iterator drew
            self.rng = None

    def fix_epoch(self, state: Any) -> None:
        # The Trainer set state.epoch = local_epoch + (local_step + 1) / steps_in_epoch; write
        # the same expression with the true epoch and step, so the value is bit for bit equal.
        # (Where the Trainer skipped the batches trained, its step counts them already.)
        local = max(self.local_epoch, 0)
        done = round((state.epoch - local) * self.steps_in_epoch)
        if local == 0 and not self.trainer_skips:
            done += self.skipped
        state.epoch = (self.offset + local) + done / self.steps_in_epoch


def processes(args: Any) -> int:
    return int(getattr(args, "world_size", 1) or 1)


def sampler_of(dataloader: Any) -> Any:
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    inner = getattr(batch_sampler, "batch_sampler", batch_sampler)  # a BatchSamplerShard
    return getattr(inner, "sampler", getattr(dataloader, "sampler", None))
