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
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any

from pcframe.integrations._common import check_resume, require_library, resolve_policy

transformers = require_library("transformers", "transformers", "transformers")

import torch  # noqa: E402  (after the guard, on purpose)

from pcframe.checkpointer import Checkpointer  # noqa: E402
from pcframe.policies.base import IntervalPolicy  # noqa: E402
from pcframe.state.rng import capture_rng, restore_rng  # noqa: E402

log = logging.getLogger("pcframe")

__all__ = ["PcframeCallback"]

SECTION = "trainer_state"  # the stateful name of the TrainerState in every version
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

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if args.world_size > 1:
            raise RuntimeError(
                f"PcframeCallback runs in one process; this run has world_size={args.world_size}"
            )
        optimizer = kwargs["optimizer"]
        dataloader = kwargs.get("train_dataloader")
        section = _TrainerStateSection(state)
        self.checkpointer = Checkpointer(
            self.output_dir,
            model=kwargs["model"],
            # accelerate wraps the optimizer; the gate goes on the torch optimizer it steps
            optimizer=getattr(optimizer, "optimizer", optimizer),
            scheduler=kwargs.get("lr_scheduler"),
            stateful={SECTION: section},
            policy=self.policy,
            **self.engine_options,
        )
        self.resumed_step, self._position = None, None
        if self.resume is False:
            return
        step = self.checkpointer.restore(None if self.resume is True else self.resume)
        if step is None:
            return  # nothing saved yet: a fresh start
        section.apply()
        self.resumed_step = step
        if dataloader is not None:
            self._position = _Position.resume(args, state, dataloader)
        if state.global_step >= state.max_steps:
            # Finished already. The loop trains a batch before it looks at this flag, so the
            # position skips every batch too: an epoch without samples stops the Trainer.
            control.should_training_stop = True
            if dataloader is not None:
                dataloader.skip_batches = len(dataloader)
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
        handle = self.checkpointer.maybe_save(step, metadata)
        last = control.should_training_stop or step >= state.max_steps
        if handle is None and self.save_last and last:
            self.checkpointer.save(step, metadata, reason="save_last")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        checkpointer, self.checkpointer = self.checkpointer, None
        if checkpointer is not None:
            checkpointer.close()


class _TrainerStateSection:
    """The ``trainer_state`` entry of a version: the TrainerState's fields, as JSON."""

    def __init__(self, state: Any) -> None:
        self.state, self.loaded = state, None

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.state)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.loaded = saved  # applied by apply() once every object is loaded

    def apply(self) -> None:
        saved, self.loaded = self.loaded, None
        if saved is None:
            raise RuntimeError(f"the restored version has no '{SECTION}' section")
        names = {f.name for f in dataclasses.fields(self.state)}
        for name, value in saved.items():
            if name in names and name not in RUN_FIELDS:
                setattr(self.state, name, value)


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
    rng: dict[str, Any] | None  # the restored RNGs, set again after the first fetch
    local_epoch: int = -1

    @classmethod
    def resume(cls, args: Any, state: Any, dataloader: Any) -> _Position:
        batches = len(dataloader)
        accumulate = args.gradient_accumulation_steps
        per_epoch = max(math.ceil(batches / accumulate), 1)  # update steps per epoch
        offset = state.global_step // per_epoch
        skipped = (state.global_step % per_epoch) * accumulate  # as the Trainer's resume
        if skipped and accumulate > 1 and batches % accumulate:
            log.warning(
                "PcframeCallback: gradient_accumulation_steps=%d does not divide the %d batches "
                "of an epoch; the rest of the interrupted epoch is not accumulated as before",
                accumulate,
                batches,
            )
        sampler = _sampler(dataloader)
        if offset and hasattr(sampler, "initial_seed"):
            sampler.initial_seed += offset  # seed = initial_seed + epoch: the true epoch's order
        elif offset and not isinstance(sampler, torch.utils.data.SequentialSampler | type(None)):
            log.warning(
                "PcframeCallback: the sampler %s has no seed to offset; epochs after the resume "
                "are ordered as the Trainer's epoch 0, 1, ... (use accelerate's seedable sampler)",
                type(sampler).__name__,
            )
        position = cls(dataloader, offset, skipped, batches, capture_rng() if skipped else None)
        if skipped:
            dataloader.skip_batches = skipped
        return position

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
