"""``PcframeCallback``: pcframe's engine as a ``transformers.Trainer`` callback.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[PcframeCallback("ckpts")])
    trainer.train()        # resumes from the newest valid pcframe version

A callback cannot change the arguments of ``Trainer.train``, so the Trainer starts as a fresh
run and the callback turns it into the resumed one in ``on_train_begin`` (where optimizer,
scheduler and the prepared dataloader exist): model, optimizer, scheduler, RNGs and
``TrainerState`` are loaded, the prepared dataloader is moved to the saved position
(:mod:`pcframe.integrations._hf_state`), and a resume mid-epoch has the Trainer skip the
batches of that epoch trained before and number the rest from there, as its own resume does
(:class:`pcframe.integrations._hf_train.ResumedEpoch`). Saves happen in ``on_step_end``, after
``optimizer.step()``; the engine's pre-hook on the next step keeps the weights unchanged until
the snapshot is copied. A step the Trainer evaluates is saved in ``on_evaluate`` instead, after
the evaluation (as the Trainer's own checkpoint is; with a dict ``eval_dataset``, after the last
set's): the evaluation draws from the global RNG (the eval dataloader's iterator, at least), and
a resumed run does not evaluate that step again.

One process runs pcframe's ``Checkpointer``; a job under ``torchrun`` / ``accelerate launch``
(DDP, accelerate's FSDP2) runs a ``DistributedCheckpointer`` on every rank
(:mod:`pcframe.integrations._hf_engine`).

The TrainerState and the data position are applied inside the engine's restore, before the
weights, after the position is checked against the data it was saved in: a refusal of any
part changes nothing. Any exit of ``train()`` closes the engine
(:mod:`pcframe.integrations._hf_train` wraps the Trainer's ``train``), which also turns
``train(resume_from_checkpoint=True)`` into a resume from pcframe's newest version.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from pathlib import Path
from typing import Any

from pcframe.integrations._common import (
    check_engine_options,
    check_flag,
    check_resume,
    close_quietly,
    policy_stopped,
    require_library,
    resolve_policy,
    stopped_by,
)

transformers = require_library("transformers", "transformers", "transformers")

import torch  # noqa: E402  (after the guard, on purpose)
from transformers.trainer_utils import IntervalStrategy, SaveStrategy  # noqa: E402

from pcframe.distributed import global_versions  # noqa: E402
from pcframe.errors import CheckpointError, PolicyError, SaveError  # noqa: E402
from pcframe.integrations._common import refused_resume  # noqa: E402
from pcframe.integrations._hf_engine import (  # noqa: E402
    Engine,
    check_folder_on_every_rank,
    fallbacks,
    job_ranks,
    notice_pending,
    open_engine,
    restore,
    resume_summary,
    save_now,
    share_trainer_state,
)
from pcframe.integrations._hf_state import (  # noqa: E402
    Position,
    TrainerStateSection,
    schedule_of,
)
from pcframe.integrations._hf_train import (  # noqa: E402
    ClosingTrain,
    ResumedEpoch,
    calling_trainer,
)
from pcframe.policies.base import IntervalPolicy  # noqa: E402
from pcframe.store.directory import CheckpointDir  # noqa: E402

# The resume, each fallback and each warning of this callback: under the library root logger
# of transformers, whose handler a default Trainer setup shows ("[transformers] ..." on
# stderr) and whose verbosity (transformers.logging.set_verbosity_*) the user already sets.
say = transformers.utils.logging.get_logger("transformers.integrations.pcframe")

__all__ = ["PcframeCallback"]

NAME = "PcframeCallback"
AGAIN = "run trainer.train() again"  # what resumes from the last committed version
OWN = [
    "output_dir",
    "policy",
    "policy_options",
    "save_steps",
    "save_last",
    "resume",
    "trainer_checkpoints",
]
# The Trainer's own names a user may try here, and what they mean for this callback.
REFUSED = {
    "save_total_limit": "is the Trainer's; pcframe keeps the newest keep_last versions "
    "(keep_last=3 by default)",
    "save_strategy": "is the Trainer's; this callback saves on its policy (save_steps=N or "
    "policy=...), and turns the Trainer's own saves off unless trainer_checkpoints=True",
    "resume_from_checkpoint": "goes to trainer.train(); here resume='auto' (the default), "
    "False or a version number",
    "dirpath": "is Lightning's name: give the folder as output_dir",
}


class PcframeCallback(transformers.TrainerCallback):
    """Save with pcframe on the policy's schedule; ``trainer.train()`` resumes the newest version.

    Args:
        output_dir: the checkpoint directory (one job at a time), another than the
            Trainer's ``output_dir`` is clearer but not required.
        policy: a :mod:`pcframe.policies` interval policy or its registered name;
            ``policy_options`` are its arguments.
        save_steps: shorthand for ``policy=FixedSteps(n)`` (the Trainer's name). Neither
            given: every 100 optimizer steps.
        save_last: also save the step after which training stops, if the policy did not.
        resume: ``"auto"`` (newest valid version; a corrupt one is quarantined and the previous
            tried), ``False`` (fresh), or a version number (one process).
            ``trainer.train(resume_from_checkpoint=True)`` resumes the newest version and
            refuses at once when there is none (as the Trainer does).
        trainer_checkpoints: keep the Trainer's own ``checkpoint-N`` folders too. By default
            the callback sets ``args.save_strategy = "no"`` (with a warning unless it was
            already), as two checkpointers writing the same state is rarely meant;
            ``load_best_model_at_end=True`` keeps them (it needs them), with a warning.
        engine_options: :class:`pcframe.config.EngineConfig` fields (``max_in_flight=2``,
            ``keep_last=3``, ...), ``tiers``, ``placement``, ``notices``, and for a job of
            several processes the ``DistributedCheckpointer``'s (``keep_global``,
            ``protocol_timeout``, ``replicas``, ...). An unknown name or a bad value is refused
            here, in one line.

    The engine is open from ``on_train_begin`` to ``on_train_end``. ``TrainerCallback``
    has no hook for an exception, so given to the Trainer's constructor the callback wraps
    that trainer's ``train`` (an instance attribute; ``del trainer.train`` removes it): any
    exit of ``train()``, KeyboardInterrupt included, closes the engine and releases the
    directory. An engine an earlier ``train()`` in this thread left open on the same
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
        trainer_checkpoints: bool = False,
        **engine_options: Any,
    ) -> None:
        if output_dir is None or str(output_dir) == "":
            raise ValueError(f"{NAME}: output_dir= is required (the checkpoint directory)")
        check_engine_options(NAME, engine_options, OWN, REFUSED)
        self.output_dir = Path(output_dir)
        self.policy = resolve_policy(policy, save_steps, "save_steps", policy_options)
        self.save_last = check_flag(NAME, "save_last", save_last)
        self.resume = check_resume(resume)
        self.trainer_checkpoints = check_flag(NAME, "trainer_checkpoints", trainer_checkpoints)
        self.engine_options = engine_options
        self.checkpointer: Engine | None = None
        self.resumed_step: int | None = None  # the step the last train() resumed from
        self._position: Position | None = None
        self._evaluated: tuple[int, dict[str, Any]] | None = None  # a step saved after its eval
        self._trainer: weakref.ReferenceType[Any] | None = None  # whose train() is running
        self._finalizer: weakref.finalize | None = None
        self._asked = False  # train(resume_from_checkpoint=True): a version must be there
        self._speaks = True  # says its warnings (rank 0 of a job of several processes)

    # --- lifecycle -------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._speaks = getattr(args, "process_index", 0) == 0
        _check_parallelism(args, None)
        self._trainer_saves(args)
        ClosingTrain.install(calling_trainer(self), self)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._speaks = bool(state.is_world_process_zero)
        required, self._asked = self._asked, False
        _check_parallelism(args, kwargs["model"])
        self._trainer_saves(args)  # a callback added with add_callback had no on_init_end
        trainer = calling_trainer(self)
        # Added after the Trainer was built (no on_init_end): wrap train() for later calls.
        ClosingTrain.install(trainer, self)
        ResumedEpoch.remove(trainer)  # left by a train() that ended before its first epoch
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self._close_stale()
        ranks = job_ranks()
        resume = True if required else self.resume
        if ranks is not None and resume not in (True, False):
            raise ValueError(
                f"{NAME}: resume={resume} (a version number) is for one process; a job of "
                f"{ranks} processes resumes the newest global version (resume='auto') or "
                "starts fresh (resume=False)"
            )
        check_folder_on_every_rank(NAME, self.output_dir, ranks)
        optimizer = kwargs["optimizer"]
        section = TrainerStateSection(
            args,
            state,
            kwargs.get("train_dataloader"),
            self._say,
            untold=ResumedEpoch.unfit(trainer),
            schedule=schedule_of(args, trainer),
        )
        checkpointer = open_engine(
            self.output_dir,
            ranks,
            model=kwargs["model"],
            # accelerate wraps the optimizer; the gate goes on the torch optimizer it steps
            optimizer=getattr(optimizer, "optimizer", optimizer),
            scheduler=kwargs.get("lr_scheduler"),
            section=section,
            policy=self.policy,
            # resume=False starts over in output_dir: its versions are this run's to prune.
            options={**self.engine_options, "take_over": resume is False},
        )
        self._hold(checkpointer)
        self.resumed_step, self._position, self._evaluated = None, None, None
        try:
            self._resume(state, control, section, resume, required)
        except BaseException:  # a refused resume: nothing was loaded; release the directory
            self._close(error=True)
            raise
        position = self._position
        if position is not None and position.trainer_skips:
            # The first epoch's _run_epoch gets the position, as in the Trainer's own resume.
            ResumedEpoch.install(trainer, position.skipped, str(self.output_dir))

    def _resume(
        self,
        state: Any,
        control: Any,
        section: TrainerStateSection,
        resume: bool | int,
        required: bool,
    ) -> None:
        if resume is False:
            return
        assert self.checkpointer is not None
        # The section applies the TrainerState and the data position inside the restore,
        # first of all objects: a refusal of any part leaves model, optimizer, scheduler,
        # TrainerState and RNG as they were.
        try:
            with section.restoring():
                step = restore(self.checkpointer, resume)
        except CheckpointError as exc:  # the saved state does not fit: one line
            refused = refused_resume(NAME, self.output_dir, exc, folder="output_dir")
            if refused is not None:
                raise refused from None
            raise
        fell_back = fallbacks(self.checkpointer, self.output_dir)
        for line in fell_back:
            self._say("%s: %s", NAME, line)
        if step is None:
            if fell_back and not required:
                self._say(
                    "%s: no version of %s is left to resume; training from the start",
                    NAME,
                    self.output_dir,
                )
            if required:
                raise ValueError(
                    f"{NAME}: resume_from_checkpoint=True, but {self.output_dir} holds no "
                    "complete version; call trainer.train() without it to start fresh"
                )
            return  # nothing saved yet: a fresh start
        share_trainer_state(self.checkpointer, section)
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
        self._say(
            "%s: resumed from %s at step %d (%s)",
            NAME,
            self.output_dir,
            step,
            resume_summary(self.checkpointer),
        )

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_evaluated(state, control)  # before the epoch's iterator draws
        if self._position is not None:
            self._position.epoch_begins()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # An evaluation that never called on_evaluate (a subclass's evaluate()): saved late
        # rather than never.
        self._save_evaluated(state, control)
        if self._position is not None:
            self._position.batch_fetched()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.checkpointer is None:
            return
        if self._position is not None:
            self._position.fix_epoch(state)
        step = state.global_step
        metadata = {"epoch": state.epoch}
        if _evaluates(args, state, control) and not notice_pending(self.checkpointer):
            # The Trainer evaluates this step after on_step_end, drawing from the global RNG,
            # and a resumed run does not evaluate it again: the version (or the policy's "no")
            # waits for on_evaluate, so its RNGs are the ones the next step draws from. A
            # pending preemption notice is answered now.
            self._evaluated = (step, metadata)
            return
        self._save(step, metadata, state, control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._evaluated is not None and self._evaluates_more(kwargs.get("metrics")):
            return  # the next eval dataset's evaluation draws from the RNG too: after it
        self._save_evaluated(state, control)

    def _evaluates_more(self, metrics: Any) -> bool:
        """Whether the Trainer evaluates another dataset after the one whose ``metrics`` it
        has just reported: ``eval_dataset`` a dict of named sets, ``evaluate`` runs each in
        order, each its own ``on_evaluate`` with metrics named ``eval_<name>_...``. Which set
        is unknown (a subclass's own metric names): no, as for a single eval set."""
        trainer = self._trainer() if self._trainer is not None else None
        datasets = getattr(trainer, "eval_dataset", None)
        if not isinstance(datasets, dict) or len(datasets) < 2 or not isinstance(metrics, dict):
            return False
        names = [str(name) for name in datasets]
        evaluated = _evaluated_set(names, [k for k in metrics if str(k).startswith("eval_")])
        return evaluated is not None and evaluated != names[-1]

    def _save_evaluated(self, state: Any, control: Any) -> None:
        """The save (or the policy's decision) of the step the Trainer has just evaluated."""
        evaluated, self._evaluated = self._evaluated, None
        if evaluated is not None and self.checkpointer is not None:
            self._save(*evaluated, state, control)

    def _save_left_over(self) -> None:
        """train() is ending by an exception (an evaluation that raised, say): the step that
        waited for its evaluation is asked for now, as its weights stand (an evaluation
        changes none), rather than lost; the close then waits for it. Never raises."""
        evaluated, self._evaluated = self._evaluated, None
        if evaluated is None or self.checkpointer is None:
            return
        try:
            self.checkpointer.maybe_save(*evaluated)
        except Exception as exc:  # the exception on its way out is the one to see
            say.warning(
                "%s: step %d, due before the error, was not saved: %s", NAME, evaluated[0], exc
            )

    def _save(self, step: int, metadata: dict[str, Any], state: Any, control: Any) -> None:
        assert self.checkpointer is not None
        try:
            handle = self.checkpointer.maybe_save(step, metadata)
            last = control.should_training_stop or step >= state.max_steps
            if handle is None and self.save_last and last:
                save_now(self.checkpointer, step, metadata)
        except SaveError as exc:
            # An earlier version failed in the background: the engine leaves the choice to
            # the loop; this callback stops training (as a failed save of the Trainer's own
            # does) rather than train on without checkpoints, and says so.
            raise stopped_by(exc, NAME, step, False, AGAIN) from exc
        except PolicyError as exc:  # the interval or placement policy broke its contract
            raise policy_stopped(exc, NAME, step, False, AGAIN) from exc

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_evaluated(state, control)
        self._close(error=False, step=state.global_step)

    # --- what the Trainer is told and asked ------------------------------------------------

    def _say(self, message: str, *args: Any) -> None:
        """A WARNING a default Trainer setup shows (once per job: rank 0)."""
        if self._speaks:
            say.warning(message, *args)

    def _trainer_saves(self, args: Any) -> None:
        """Turn the Trainer's own checkpoints off (``save_strategy="no"``), saying so."""
        strategy = getattr(args, "save_strategy", SaveStrategy.NO)
        if self.trainer_checkpoints or strategy == SaveStrategy.NO:
            return
        where = (
            f"pickled checkpoint-N folders in {args.output_dir}, beside pcframe's {self.output_dir}"
        )
        if getattr(args, "load_best_model_at_end", False):
            self._say(
                "%s: the Trainer writes its own checkpoints as well (%s), as "
                "load_best_model_at_end=True needs them",
                NAME,
                where,
            )
            return
        every = f", save_steps={args.save_steps}" if strategy == SaveStrategy.STEPS else ""
        args.save_strategy = SaveStrategy.NO
        self._say(
            "%s: turned the Trainer's own checkpoints off (save_strategy=%r%s: %s); set "
            "save_strategy='no' to say so, or pass %s(trainer_checkpoints=True) to keep them",
            NAME,
            str(getattr(strategy, "value", strategy)),
            every,
            where,
            NAME,
        )

    def _resume_argument(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``trainer.train()``'s arguments, ``resume_from_checkpoint`` as a Trainer user means
        it: ``True`` (or this callback's folder) is the newest pcframe version, refused at
        once if there is none; a Trainer checkpoint is refused at once unless ``resume=False``
        (then the Trainer loads it, and pcframe saves from there)."""
        named = "resume_from_checkpoint" in kwargs
        given = kwargs["resume_from_checkpoint"] if named else (args[0] if args else None)
        if given is None or given is False:
            return args, kwargs
        ours = given is True or (
            isinstance(given, str | os.PathLike) and _key(Path(given)) == _key(self.output_dir)
        )
        if not ours:
            if self.resume is False:
                return args, kwargs
            raise ValueError(
                f"{NAME} resumes from its own folder {self.output_dir}, not from "
                f"resume_from_checkpoint={given!r}: pass resume_from_checkpoint=True (pcframe's "
                f"newest version) or nothing, or {NAME}(..., resume=False) to let the Trainer "
                "load that checkpoint"
            )
        if not _has_versions(self.output_dir):
            raise ValueError(
                f"{NAME}: resume_from_checkpoint=True, but {self.output_dir} holds no pcframe "
                "checkpoint; call trainer.train() without it (it resumes on its own once there "
                "is one)"
            )
        self._asked = True
        if named:
            return args, {**kwargs, "resume_from_checkpoint": None}
        return (None, *args[1:]), kwargs

    # --- holding the directory -------------------------------------------------------------

    def _hold(self, checkpointer: Engine) -> None:
        self.checkpointer = checkpointer
        _OPEN[_key(self.output_dir)] = _Opened(weakref.ref(self), threading.current_thread())
        # A callback dropped with its engine open (its Trainer gone) releases it.
        self._finalizer = weakref.finalize(self, close_quietly, checkpointer, NAME)
        self._finalizer.atexit = False  # the engine's own atexit closes it then

    def _close(self, error: bool, step: int | None = None) -> None:
        """Close the engine; ``error``: after an exception (never raises over it).
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
        except PolicyError as exc:  # closed all the same: the placement failed at the end
            self._forget()
            raise policy_stopped(exc, NAME, step or 0, True, AGAIN) from exc
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
        callback's engine, or another callback's on this directory from this thread (or a
        thread that has ended), as no train() of it can still be running."""
        if self.checkpointer is not None:
            say.warning("%s: closing the Checkpointer an earlier train() left open", NAME)
            self._close(error=True)
        held = _OPEN.get(_key(self.output_dir))
        other = held.callback() if held is not None else None
        if other is None or other is self or other.checkpointer is None:
            return
        assert held is not None
        if held.thread is threading.current_thread() or not held.thread.is_alive():
            say.warning(
                "%s: closing the Checkpointer of %s an earlier train() left open (it ended by "
                "an exception)",
                NAME,
                self.output_dir,
            )
            other._close(error=True)


def _check_parallelism(args: Any, model: Any) -> None:
    """Refuse, in one line, the parallelism whose state this callback does not snapshot."""
    if getattr(args, "deepspeed", None):
        raise ValueError(
            f"{NAME} does not support DeepSpeed (its engine owns the optimizer and the ZeRO "
            "partitions): use FSDP2 (fsdp=True, fsdp_config={'version': 2}) or DDP, or the "
            "Trainer's own checkpoints"
        )
    fsdp1 = torch.distributed.is_available() and isinstance(
        model, torch.distributed.fsdp.FullyShardedDataParallel
    )
    config = getattr(args, "fsdp_config", None) or {}
    if fsdp1 or (getattr(args, "fsdp", None) and str(config.get("version", 2)) == "1"):
        raise ValueError(
            f"{NAME} supports FSDP2 (DTensor parameters), not FSDP1: set "
            "fsdp_config={'version': 2} (the default)"
        )


def _evaluates(args: Any, state: Any, control: Any) -> bool:
    """Whether the Trainer evaluates after this step's ``on_step_end``: ``DefaultFlowCallback``
    (the first callback) asked for it (``eval_strategy="steps"``, and the last step), or the
    epoch ends here under ``eval_strategy="epoch"`` (its last step, or training stops)."""
    if control.should_evaluate:
        return True
    if getattr(args, "eval_strategy", IntervalStrategy.NO) != IntervalStrategy.EPOCH:
        return False
    stops = control.should_epoch_stop or control.should_training_stop
    ends = stops or state.global_step >= state.max_steps or float(state.epoch).is_integer()
    return ends and args.eval_delay <= state.epoch


def _evaluated_set(names: list[str], keys: list[str]) -> str | None:
    """The eval set whose metrics ``keys`` are (``eval_<name>_loss``, ...): the longest name
    that prefixes every key (``"a"`` and ``"a_b"`` both prefix ``eval_a_b_loss``)."""
    fits = [name for name in names if keys and all(k.startswith(f"eval_{name}_") for k in keys)]
    return max(fits, key=len) if fits else None


def _has_versions(directory: Path) -> bool:
    return bool(
        CheckpointDir(directory).committed_versions() or global_versions.record_versions(directory)
    )


@dataclasses.dataclass
class _Opened:
    callback: weakref.ReferenceType[PcframeCallback]
    thread: threading.Thread


_OPEN: dict[str, _Opened] = {}  # directory -> the callback holding it open in this process


def _key(directory: Path) -> str:
    return os.path.realpath(directory)
