"""The user-facing engine: ``Checkpointer`` for a plain PyTorch training loop.

This is the front door only: it wires the stages (:mod:`pcframe.save` capture, pipeline
and in-flight bookkeeping; :mod:`pcframe.store` directory, retention and tiers;
:mod:`pcframe.restore` sources, reader and apply) and feeds the interval policy.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

import torch

from pcframe.config import EngineConfig
from pcframe.decisions import Decisions
from pcframe.errors import CheckpointError, PolicyError, SaveError
from pcframe.format.names import check_new_version
from pcframe.policies.base import Decision, IntervalPolicy, Notice, PolicyContext
from pcframe.policies.fixed import FixedSteps
from pcframe.policies.notices.base import NoticeSource
from pcframe.policies.placement.base import PlacementPolicy
from pcframe.restore.report import RestoreReport
from pcframe.restore.restorer import RestoreJob, load_rules, restore_from_tiers
from pcframe.runtime.checks import bounded_wait
from pcframe.runtime.collector import current_frames
from pcframe.runtime.interrupts import interrupts_held
from pcframe.runtime.threads import (
    EngineCalls,
    Reentry,
    check_timeout,
    engine_call,
    on_stack,
    one_caller_at_a_time,
)
from pcframe.save.capture import Capture
from pcframe.save.flight import DeferredSave, EngineSaveHandle, InFlight
from pcframe.save.handle import SaveHandle, SaveRecord, VersionHandle
from pcframe.save.pipeline import SavePipeline
from pcframe.state.objects import Stateful, TrainingObjects, require_step_hook
from pcframe.store.directory import WritableCheckpointDir
from pcframe.store.starts import UNKNOWN_WRITER
from pcframe.store.tiers import Secured, Tiers, attach_tiers
from pcframe.text import one_line, value_text

log = logging.getLogger("pcframe")

# At interpreter exit, wait at most this long for versions still being written.
CLOSE_TIMEOUT_AT_EXIT = 600.0

__all__ = ["Checkpointer", "RestoreReport", "SaveHandle", "SaveRecord"]

# Why decide() and maybe_save() are refused in the middle of another engine call.
_NEEDS_THE_POLICY = (
    "the interval policy may be mid-update there: in a signal handler call save(step) (it "
    "runs once {running}() has returned), or record the signal and save from the loop "
    "(notices=[SignalNoticeSource()] with policy=NoticeDriven(...), or set a flag)"
)


def _checked_reason(reason: Any) -> str:
    """``save()``'s ``reason`` (``None``: none); anything but a str is refused by name.

    It is stored as the version's ``metadata["reason"]``: a number or an object went into
    the manifest as whatever JSON made of it, or failed the save later in the pipeline.
    """
    if reason is None:
        return ""
    if not isinstance(reason, str):
        raise TypeError(
            f"reason={value_text(reason)} ({type(reason).__name__}): the save's reason is a "
            "str, e.g. save(step, reason='epoch end')"
        )
    return reason


class Checkpointer:
    """Concurrent, crash-safe checkpointing for a training loop.

    Args:
        directory: where versions are written (one writer process per directory).
        model, optimizer, scheduler, scaler: the usual torch objects (all optional).
        data: a stateful data position (e.g. :class:`pcframe.state.data.ResumableLoader`).
        stateful: more named objects with ``state_dict()`` / ``load_state_dict()``.
        extra: a JSON-able dict saved with every version and updated in place on restore
            (a Counter, OrderedDict, defaultdict, namedtuple or enum member in it comes
            back as one: :mod:`pcframe.format.tree`).
        policy: decides when :meth:`maybe_save` saves (default: every 100 steps).
        config: engine knobs; keyword overrides (``max_in_flight=4``) are applied on top.
        tiers: replica tiers, name -> directory, URL or :class:`~pcframe.store.tiers.Tier`
            (or a configured :class:`~pcframe.store.tiers.Tiers`); ``directory`` is the
            primary tier.
        placement: which tiers get each version and what each keeps; its first tier names
            ``directory`` (e.g. ``MemoryThenDisk()`` with ``directory`` on /dev/shm).
        notices: preemption notice sources polled in :meth:`maybe_save`; the notice is passed
            to the policy as ``ctx.notice`` (e.g. for ``NoticeDriven`` without its own source).
        save_last: at a normal :meth:`close`, save the last step :meth:`maybe_save` saw if
            no version holds it yet (like Lightning's ``save_last``), so a finished run can
            be resumed or exported from its final state.
        take_over: let this run's retention (``keep_last``) delete the committed versions
            ``directory`` already holds though it did not restore any of them. Without it
            the first save into such a folder is refused (they may be another run's, or
            another model's); :meth:`restore` (or :meth:`resumed`) takes the folder over.

    The optimizer step is gated: ``optimizer.step()`` waits until the snapshot of the weights
    it is about to change has been copied. Call :meth:`wait_for_snapshot` before changing
    parameters any other way while a save is in flight.

    Signal handlers (a spot VM's SIGTERM): a handler may call ``save(step).wait()``,
    ``wait()`` and ``close()``, then ``sys.exit(0)``. Landing in the middle of one of this
    engine's calls on the same thread, these run once that call has returned or unwound
    (the ``sys.exit`` unwinds it: the save is committed and the engine closed on the way
    out); ``decide()`` and ``maybe_save()`` are refused there (:mod:`pcframe.runtime.threads`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        data: Stateful | None = None,
        stateful: Mapping[str, Stateful] | None = None,
        extra: dict[str, Any] | None = None,
        policy: IntervalPolicy | None = None,
        config: EngineConfig | None = None,
        tiers: Tiers | Mapping[str, Any] | None = None,
        placement: PlacementPolicy | None = None,
        notices: Sequence[NoticeSource] | None = None,
        save_last: bool = False,
        take_over: bool = False,
        **overrides: Any,
    ) -> None:
        if not isinstance(take_over, bool):
            raise TypeError(f"take_over={value_text(take_over)}: give True or False")
        config = (config or EngineConfig()).with_overrides(**overrides)
        config.check_runtime()  # e.g. copy_backend="triton" without CUDA: refuse before locking
        self.config = config
        self._decisions = Decisions(
            policy if policy is not None else FixedSteps(100), notices or []
        )
        self._objects = TrainingObjects.given(
            model, optimizer, scheduler, scaler, data, stateful, extra, self.policy
        )
        require_step_hook(optimizer)  # before locking: nothing to undo
        self._storage = WritableCheckpointDir(directory)
        # A failure on the way leaves no lock, no handler, no tier thread, the mark kept:
        # every undo is tried (its own failure ignored), the lock released last.
        with contextlib.ExitStack() as undo:
            undo.callback(self._storage.abandon)
            if leftovers := self._storage.removed_leftovers:
                log.info("removed leftovers of an interrupted run: %s", leftovers)
            self._next_version = self._storage.next_version()
            self.last_secured: Secured | None = None  # where the last emergency version went
            self._notice_secured: Notice | None = None  # the notice that sent it there
            self.tiers, newest = attach_tiers(tiers, placement, self._storage, config.keep_last)
            self._number_above(newest)  # no tier sees a version number reused
            undo.callback(_quietly, functools.partial(self.tiers.close, hurry=True))
            for source in self.notices:
                undo.callback(_quietly, source.close)  # first: a half-done start is undone
                source.start()  # signal handlers: must run in the main thread
            self._capture = Capture(self._objects, config)
            self._flight = InFlight(config.max_in_flight)
            self._pipeline = SavePipeline(config, self._storage, self._flight.finished)
            self._flight.wait_for_copies = self._pipeline.wait_for_copies
            self.tiers.follow(self._pipeline)
            self._flight.late_failures.append(self.tiers.take_failure)
            self._resume_failures: list[PolicyError] = []  # see _resumed_after_restore()
            self._flight.late_failures.append(self._take_resume_failure)
            self._engine_calls = EngineCalls()  # this engine's calls in progress, per thread
            self._in_step_hook = 0  # optimizer.step() runs one of the hooks (close: keep them)
            self._stepping: dict[int, Any] = {}  # thread -> its optimizer.step() in progress
            # A save on another thread than an optimizer.step() in progress waits for its end
            # (else its capture read some weights before the update and the rest after it):
            # thread -> the frame that called step(). Marked under `_capturing`, which every
            # save holds from that wait to its hand-off (only then: a long call of another
            # thread, close() or an emergency upload, never holds up the training step).
            self._capturing = threading.RLock()
            self._updating: dict[int, FrameType] = {}
            self._update_ended = threading.Condition()
            # Weak references: hooks left in place (close() inside one) keep nothing alive.
            engine = weakref.ref(self)
            self._hooks = []
            if optimizer is not None:
                self._hooks.append(
                    optimizer.register_step_pre_hook(functools.partial(_step_pre_hook, engine))
                )
                undo.callback(_quietly, self._hooks[-1].remove)
                # A multi-rank optimizer view has none: its steps are gated, not tracked.
                if callable(post := getattr(optimizer, "register_step_post_hook", None)):
                    self._hooks.append(post(functools.partial(_step_post_hook, engine)))
                    undo.callback(_quietly, self._hooks[-1].remove)
            self._storage.count_start()  # fully built: from here on, an end without close() counts
            undo.pop_all()
        self.last_restore: RestoreReport | None = None
        self._closed = False
        self.save_last = save_last
        # Whether retention may delete the versions the folder held when it opened: a run
        # that restored (or was told it resumed) continues them; any other must say so.
        self._taken_over = take_over
        self._pid = os.getpid()  # the process that opened it: the one that closes it
        atexit.register(self._atexit)

    # The live objects, as given (read-only views of self._objects).
    model = property(lambda self: self._objects.model)
    optimizer = property(lambda self: self._objects.optimizer)
    scheduler = property(lambda self: self._objects.scheduler)
    scaler = property(lambda self: self._objects.scaler)
    stateful = property(lambda self: self._objects.stateful)
    extra = property(lambda self: self._objects.extra)
    # The policy side (:class:`~pcframe.decisions.Decisions`), read-only.
    policy = property(lambda self: self._decisions.policy)
    notices = property(lambda self: self._decisions.notices)
    feed = property(lambda self: self._decisions.feed)
    last_decision = property(lambda self: self._decisions.last)
    notice = property(lambda self: self._decisions.notice)

    # Each version's save costs (updated at each engine call); the one Retention object.
    records = property(lambda self: self._flight.records)
    retention = property(lambda self: self._pipeline.retention)

    # --- saving ----------------------------------------------------------------------------

    @one_caller_at_a_time(fix=_NEEDS_THE_POLICY)
    def maybe_save(
        self, step: int, metadata: dict[str, Any] | None = None, notice: Notice | None = None
    ) -> SaveHandle | None:
        """Ask the interval policy whether to save at ``step``; save if it says so."""
        decision = self._decide(step, notice)
        notice = self._decisions.notice  # given, polled from the sources, or the policy's
        unanswered = notice is not None and not notice.same_as(self._notice_secured)
        if not decision.save:
            if unanswered:
                self._secure_newest(notice)
            return None
        handle = self._save(step, metadata, reason=decision.reason)
        # An emergency save, or a routine one at a notice not yet answered (a policy that
        # does not read notices saved at the notice's step: the version is the newest).
        if decision.emergency or unanswered:
            handle.wait_here()  # durable in the primary; now in a tier that survives (if any)
            self._notice_secured = notice
            self.last_secured = self.tiers.secure(handle.version, step, notice)
        return handle

    def _secure_newest(self, notice: Notice) -> None:
        """A notice the policy answered without a save (the step is saved already, or a save
        would not finish in the window): the newest committed version, once the saves in
        flight are, goes to the tier that outlives the VM within the window, as an emergency
        version would (else a version on local disk only was lost with the VM though the
        window had room to upload it)."""
        self._notice_secured = notice
        if not self.tiers.replicated:
            return
        self._flight.wait_all(bounded_wait(notice.deadline - time.monotonic()))
        versions = self._storage.committed_versions()
        if not versions:
            return
        version = versions[-1]
        record = self.records.get(version)
        try:
            step = record.step if record is not None else self._storage.step_of(version)
        except CheckpointError as exc:
            log.error("preemption notice: version %d cannot be secured: %s", version, exc)
            return
        self.last_secured = self.tiers.secure(version, step, notice)

    @one_caller_at_a_time(fix=_NEEDS_THE_POLICY)
    def decide(self, step: int, notice: Notice | None = None) -> Decision:
        """The interval policy's answer at ``step``, without acting on it.

        Measures the iteration time, polls the notice sources and records the pending
        notice, as :meth:`maybe_save` does (which is ``decide`` plus the save it asks for);
        multi-rank jobs use it to agree on one decision before saving together. Before the
        first save, a decision not to save may also size the state and start allocating
        the staging pool on a thread of its own (:meth:`SavePipeline.prepare`).
        """
        return self._decide(step, notice)

    def _decide(self, step: int, notice: Notice | None) -> Decision:
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step={step!r}: the training step is an int")
        self._flight.report(self._decisions.committed)
        decision = self._decisions.decide(step, notice, self.tiers, self._flight.occupancy())
        if not decision.save:  # the staging pool, ahead of the first save
            self._pipeline.prepare(lambda: self._capture.new_footprint(self._flight.steps))
        return decision

    def context(
        self, step: int, now: float | None = None, notice: Notice | None = None
    ) -> PolicyContext:
        """The :class:`PolicyContext` the policy sees at ``step`` (also for custom loops)."""
        now = time.monotonic() if now is None else now
        return self._decisions.context(step, now, notice, self.tiers, self._flight.occupancy())

    @one_caller_at_a_time(reentry=Reentry.DEFERRED, later="_save_later")
    def save(
        self,
        step: int,
        metadata: dict[str, Any] | None = None,
        *,
        reason: str = "",
        version: int | None = None,
    ) -> VersionHandle:
        """Start a checkpoint of the current state at ``step``; returns at once (mostly).

        Blocks only while ``max_in_flight`` versions are already in flight (backpressure),
        and, without an optimizer to gate, until the snapshot is copied. ``version`` forces
        the version number (coordinated multi-rank saves); it must be above every earlier one.

        Called by a signal handler in the middle of another call of this engine on the same
        thread, it starts once that call has returned, and returns a :class:`DeferredSave`
        (its ``wait()`` there returns ``IN_FLIGHT`` at once; see the class docstring).
        """
        return self._save(step, metadata, reason=_checked_reason(reason), version=version)

    def _save(
        self,
        step: int,
        metadata: dict[str, Any] | None = None,
        *,
        reason: str = "",
        version: int | None = None,
    ) -> EngineSaveHandle:
        check_new_version(version, self._next_version)
        self._check_open()
        if not self._taken_over:
            self._take_over()
        self._flight.report(self._decisions.committed)
        entered = time.perf_counter()
        metadata = {**(metadata or {}), "reason": reason} if reason else (metadata or {})
        self._flight.acquire()  # blocks while max_in_flight versions are in flight
        number = None
        try:
            with self._capturing:  # no optimizer.step() of another thread starts meanwhile
                self._other_steps()
                # Taken before the capture, so no save that starts meanwhile can take it too.
                number = self._take_number(version)
                progress = self._flight.start(
                    self._capture, self._pipeline, number, step, metadata, entered
                )
        finally:
            if number is not None and number not in self._flight.records:
                self._give_back(number)  # never started: no folder, no record holds it
        if self.optimizer is None:
            # Nothing gates the next update: the copy is done before this returns.
            self._flight.wait_for_copies([progress])
        progress.stall += time.perf_counter() - entered
        self._decisions.saved(step)
        return EngineSaveHandle(progress, self._engine_calls, self._flight)

    def _take_over(self) -> None:
        """Before this run's first save: its retention counts every committed version of the
        folder and of its replica tiers, so versions it neither restored nor was allowed to
        take over (another run's, another model's) would be deleted as its own saves
        outnumber ``keep_last``. A replica tier counts too: on a new VM the folder is empty
        while the object store still holds the previous run's versions.

        Raises:
            CheckpointError: the folder or a replica tier holds such versions (nothing is
                saved).
        """
        held = {str(self._storage.root): tuple(self._storage.committed_versions())}
        if self.tiers.replicated:  # as last listed (at open): no listing call here
            held.update(
                (f"tier {name!r}", versions)
                for name, versions in self.tiers.committed().items()
                if name != self.tiers.primary_name
            )
        held = {where: versions for where, versions in held.items() if versions}
        if held:
            which = " and ".join(
                f"{where} holds committed {_versions_text(v)}" for where, v in held.items()
            )
            raise CheckpointError(
                f"{which} that this Checkpointer did not restore (another run's or another "
                f"model's?), which its keep_last={self.config.keep_last} would delete: call "
                "restore() first to continue from them, give this run another folder (and "
                "tiers), or pass Checkpointer(..., take_over=True) to let this run replace them"
            )
        self._taken_over = True  # nothing there: every version from here on is this run's

    def _take_number(self, forced: int | None) -> int:
        """The next version's number (``forced``: checked by the caller), counted at once."""
        number = self._next_version if forced is None else forced
        self._next_version = number + 1
        return number

    def _give_back(self, number: int) -> None:
        """A save that did not start frees its number, unless a later one was taken."""
        if self._next_version == number + 1:
            self._next_version = number

    def _save_later(
        self,
        step: int,
        metadata: dict[str, Any] | None = None,
        *,
        reason: str = "",
        version: int | None = None,
    ) -> DeferredSave:
        """``save()`` in the middle of another call of this engine on the same thread."""
        reason = _checked_reason(reason)  # refused now, in the caller, not when it runs

        def save_now() -> VersionHandle:
            if self._closed:
                raise CheckpointError(
                    f"the save of step {step} was asked for (by a signal handler?) while "
                    "close() shut the engine down after its last version: not saved (the "
                    f"last version is {self._next_version - 1})"
                )
            while True:
                first = self._next_version
                try:
                    return self.save(step, metadata, reason=reason, version=version)
                except SaveError as exc:
                    if exc.version >= first:
                        raise
                    # An earlier version's failure, raised before this one started: the
                    # save a handler asked for (an emergency one, as likely as not) goes on.
                    log.error("before the save of step %d: %s", step, exc)

        call = self._engine_calls.defer("save", save_now)
        return DeferredSave(call, step, self._engine_calls)

    @engine_call(reentry=Reentry.DEFERRED)
    def wait_for_snapshot(self) -> None:
        """Block until every in-flight snapshot has been copied (not necessarily persisted)."""
        self._flight.gate()

    @engine_call(reentry=Reentry.DEFERRED)
    def wait(self, timeout: float | None = None) -> None:
        """Block until every in-flight version is committed, discarded or failed.

        Raises:
            SaveError: for the first failed version not yet reported.
            CheckpointError: ``timeout`` seconds passed first (the versions go on).
        """
        check_timeout(timeout, "wait")
        self._wait(timeout)

    def _wait(self, timeout: float | None = None) -> None:
        self._check_open()
        self._wait_all(timeout, "wait", "wait again")
        self._flight.report(self._decisions.committed)

    @engine_call(name="optimizer.step", owner="", fix="step the optimizer from the loop")
    def _gate(self, *, count: bool) -> None:
        """The optimizer step's wait for the snapshots of the weights it is about to change."""
        self._flight.gate(count=count)

    def _wait_all(self, timeout: float | None, call: str, again: str) -> None:
        if not self._flight.wait_all(timeout):
            raise CheckpointError(
                f"{call}: version(s) {self._flight.in_flight_versions()} still in flight after "
                f"{timeout:.0f} s (writing to {self._storage.root}): the storage is slow or "
                f"stuck; {again}, or stop the process (the last committed version is intact)"
            )

    def add_commit_listener(self, listener: Any) -> None:
        """Call ``listener(version, path, manifest)`` on the commit thread after each commit.

        Listeners must be quick or hand work to their own thread (uploaders, tier copies); an
        exception is logged and does not undo the commit.
        """
        self._pipeline.commit_listeners.append(listener)

    # --- restoring ---------------------------------------------------------------------------

    def committed_versions(self) -> list[int]:
        return self._storage.committed_versions()

    @one_caller_at_a_time(alone=True)  # a save from a signal handler meanwhile is refused
    def restore(
        self, version: int | None = None, *, strict: bool = True, allow_cast: bool = False
    ) -> int | None:
        """Load the newest valid committed version (or ``version``); return its step.

        A version that fails verification is logged, recorded in :attr:`last_restore`,
        moved aside as ``.corrupt-vNNNNNNNN-<pid>`` and the next older one is tried; an I/O
        error is retried, then raised, renaming nothing. Returns ``None`` when there is no
        checkpoint. The version is checked against every object before any is touched
        (``pcframe.state.check``): a failed restore changes nothing. An interrupt while it
        commits is raised once it is complete (:mod:`pcframe.runtime.interrupts`); an earlier save's
        failure found while it waits is logged, not raised, whatever the restore does. The
        policy's failure on being told of the restart is raised as a ``PolicyError`` at the
        next engine call (:meth:`_resumed_after_restore`): the restore holds by then.

        Args:
            strict: any mismatch raises (the default); ``False`` loads what fits and lists
                the rest in ``last_restore.not_loaded``.
            allow_cast: cast tensors saved in another dtype (else a dtype is a mismatch).

        Raises:
            NoValidCheckpoint: every committed version failed verification.
            RestoreIOError: the newest version (or a tier's listing) cannot be read: storage.
            UnsupportedCheckpoint: it is of a newer format or codec (renaming nothing).
            CheckpointError: the version does not fit the objects (``StateMismatch`` lists
                every mismatch); not corruption: nothing is quarantined.
        """
        rules = load_rules("restore", strict, allow_cast)
        while True:  # no save in flight: the staging pool is idle, lent to the restore
            try:
                self._wait()
                break
            except (SaveError, PolicyError) as exc:  # PolicyError: a placement's, after a commit
                log.error("before the restore: %s", exc)
        report = self.last_restore = RestoreReport()
        job = RestoreJob(
            self._objects, rules, self.config.read_threads, self._storage.root, report, version
        )
        manifest = restore_from_tiers(
            self.tiers,
            version,
            job,
            self._pipeline.pool,
            self._number_above,  # every version any tier holds, valid or not
            lambda manifest: self._resumed_after_restore(manifest.step, manifest.engine),
        )
        if manifest is None:
            self.restarted_empty()
            return None
        return manifest.step

    def _number_above(self, version: int) -> None:
        """New versions are numbered above ``version``."""
        self._next_version = max(self._next_version, version + 1)

    def resumed(self, step: int, written: Mapping[str, Any] | None = UNKNOWN_WRITER) -> None:
        """Training goes on from ``step``, whose state was just loaded: tell the policy.

        ``written``: the loaded manifest's ``engine`` section, which names its writer
        (:meth:`Starts.unseen`); ``None``: nothing was loaded. Called by a multi-rank
        restore that loaded the state itself, where the policy's failure must raise here:
        the ranks agree on it, and every rank stops (:meth:`restore` defers it instead).
        Training continues the folder's versions: retention may delete them from here on.
        """
        self._taken_over = True  # training continues the folder's versions: they are its own
        starts, clean = self._storage.starts, self._storage.previous_exit_clean
        self._decisions.resumed(step, written, starts, clean)

    def _resumed_after_restore(self, step: int, written: Mapping[str, Any] | None) -> None:
        """:meth:`resumed` for :meth:`restore`, which has committed the state by then."""
        try:
            self.resumed(step, written)
        except Exception as exc:
            # The policy is told once the restored state holds, past the point a restore can
            # be taken back: raised from here, restore() looked failed with every object
            # loaded. The failure is the policy's: raised at the next engine call, as a
            # placement policy's after a commit is. (One process: no rank is left waiting.)
            policy = type(self._decisions.policy)
            failure = PolicyError(
                f"policy {policy.__module__}.{policy.__qualname__}.observe raised "
                f"{one_line(f'{type(exc).__name__}: {exc}')} when told that training "
                f"resumes from step {step}; the restore holds (the objects hold that "
                "step's state): fix the policy"
            )
            failure.__cause__ = exc
            log.error("%s", failure)
            self._resume_failures.append(failure)

    def _take_resume_failure(self, reported: Callable[[int], bool]) -> PolicyError | None:
        """The policy's failure on being told of a restore (:meth:`_resumed_after_restore`),
        taken once."""
        del reported  # it follows a restore, not a version in flight
        return self._resume_failures.pop(0) if self._resume_failures else None

    # --- lifecycle ---------------------------------------------------------------------------

    # Refused during a restore (it would release the lock under it); from a handler in the
    # middle of another call, it closes once that call has returned.
    @one_caller_at_a_time(reentry=Reentry.DEFERRED)
    def close(self, timeout: float | None = None, *, clean: bool = True) -> None:
        """Wait for in-flight versions, stop the threads, release the directory lock.

        A normal close marks a clean exit (the next run's ``Restarted.clean``) and, with
        ``save_last=True``, first saves the last step seen if it is newer than the last
        version. ``clean=False`` closes without either: as leaving a ``with`` block on an
        exception, or exiting the interpreter on an unhandled one, does.

        Raises:
            SaveError: for the first failed version not yet reported (closed all the same).
            PolicyError: else, for a failure of the placement policy not yet reported, the
                replicas' last copies included (closed all the same; logged instead when
                ``clean=False``).
            CheckpointError: in-flight versions did not finish within ``timeout`` seconds;
                the engine stays open (call ``close()`` again to keep waiting).
        """
        check_timeout(timeout, "close")
        if self._closed:
            return
        if clean and self.save_last and self.notice is None:
            self._save_last()
        self._wait_all(timeout, "close", "call close() again to keep waiting")
        # A signal handler's save (and wait) while this waited: before the end, as if this
        # call had returned first, and waited for like the rest.
        while self._engine_calls.drain_here():
            if self._closed:  # the handler's close() ran there
                return
            self._wait_all(timeout, "close", "call close() again to keep waiting")
        self._shut_down(clean)

    def _shut_down(self, clean: bool) -> None:
        """Stop the pipeline, the tiers, the lock. The steps that must not be cut short run
        with signals held (:mod:`pcframe.runtime.interrupts`): a handler's ``sys.exit()``
        there is raised once they are done (the calls it made are deferred to the end of
        ``close()``, and find the engine closed). The replicas' drain is not held: Ctrl-C
        may cut that wait short, and the lock is released all the same. A failure of the
        placement policy no call raised yet (one during the replicas' drain, say) is raised
        at the end of a clean close; logged instead when an error ends the close, or ends
        the ``with`` block that closes it (``clean=False``: that error is the one raised; a
        broken policy's next failure is not raised over it)."""
        if not clean:
            self._flight.late_failures.clear()
        try:
            self._shut_down_all(clean)
        except BaseException:
            if (late := self.tiers.take_failure()) is not None:
                log.error("%s", late)
            raise
        if (late := self.tiers.take_failure()) is not None:
            if not clean:
                log.error("%s", late)
                return
            raise late

    def _shut_down_all(self, clean: bool) -> None:
        try:
            with interrupts_held():
                try:
                    self._wait()
                finally:
                    self._closed = True  # from here the gate lets every step through
                    # Not from inside a hook (a handler's close() deferred to its end):
                    # removing a hook while optimizer.step() runs its hooks breaks the loop
                    # over them. Hooks left behind do nothing and hold the engine weakly.
                    for hook in self._hooks if not self._in_step_hook else ():
                        hook.remove()
                    try:
                        self._decisions.close()  # e.g. restore signal handlers, stop pollers
                    finally:  # a policy's close() that raises stops no thread of ours
                        self._pipeline.close()
        finally:
            drained = False
            try:
                # After the last commit, before the lock is released; preempted: no time to
                # drain.
                self.tiers.close(hurry=self.notice is not None)
                drained = True
            finally:
                with interrupts_held():
                    # A preempted or crashed run's restart is not a clean one.
                    if drained and clean and self.notice is None:
                        with contextlib.suppress(OSError):
                            self._storage.mark_clean_exit()
                    self._storage.close()
                    atexit.unregister(self._atexit)

    def _save_last(self) -> None:
        if (step := self._decisions.unsaved_step()) is None:
            return
        if not self._taken_over:
            try:
                self._take_over()
            except CheckpointError as exc:
                # Raised from close(), it left the engine open and its lock held (each close
                # again refused the same): the engine closes, the step is not saved.
                log.error("save_last: step %d not saved: %s", step, exc)
                return
        self._save(step, reason="save_last")

    def _step_pre_hook(self) -> None:
        """``optimizer.step()``'s pre-hook: the gate, as an engine call (a handler's save
        during its wait runs once the gate is over: before the update, so it holds the
        weights the signal interrupted; then its copy is waited for too). Then the update
        itself is an engine call until the post-hook: a handler's save in the middle of it
        runs after it, on a whole step (half the weights and moments updated were saved, and
        the step's first update could leave the optimizer's state half made). A save on
        another thread waits from the end of the gate to the post-hook
        (:meth:`_other_steps`)."""
        self._in_step_hook += 1
        try:
            tracked = len(self._hooks) == 2  # a post-hook ends the update
            thread, frame = threading.get_ident(), _outside_engine(sys._getframe())
            count = True
            while not self._closed:
                self._gate(count=count)  # calls a handler made meanwhile run as it returns
                count = False
                if not tracked:
                    if not self._flight.copying():
                        break
                    continue
                # The update is an engine call from here (a handler's call waits for the
                # post-hook; ends there, or once the step's frame has returned if it raised),
                # and marked for other threads' saves under the lock each of them holds to its
                # hand-off: one under way is handed over first, and its copy waited for below.
                entry = self._engine_calls.enter("optimizer.step", frame)
                with self._capturing, self._update_ended:
                    self._updating[thread] = frame
                    if self._closed or not self._flight.copying():
                        self._stepping[thread] = entry
                        break
                    del self._updating[thread]  # a save started since the gate: gate again
                self._engine_calls.leave(entry)  # (a handler's call made meanwhile runs now)
        finally:
            self._in_step_hook -= 1

    def _step_post_hook(self) -> None:
        """``optimizer.step()``'s post-hook: the update is over; what a signal handler asked
        for meanwhile runs now."""
        thread = threading.get_ident()
        with self._update_ended:
            if self._updating.pop(thread, None) is not None:
                self._update_ended.notify_all()
        entry = self._stepping.pop(thread, None)
        if entry is None:
            return
        self._in_step_hook += 1
        try:
            self._engine_calls.leave(entry)
        finally:
            self._in_step_hook -= 1

    def _other_steps(self) -> None:
        """Wait until no other thread is inside ``optimizer.step()`` (between its hooks): a
        save's capture then reads every weight on one side of the update. A step that raised
        (no post-hook) counts as over once its caller's frame has left that thread's stack."""
        me = threading.get_ident()
        with self._update_ended:
            while True:
                others = [thread for thread in self._updating if thread != me]
                if not others:
                    return
                stacks = current_frames()
                for thread in others:
                    if not on_stack(self._updating[thread], stacks.get(thread)):
                        del self._updating[thread]
                if any(thread != me for thread in self._updating):
                    self._update_ended.wait(0.05)

    def _atexit(self) -> None:
        if os.getpid() != self._pid:
            # A child forked without exec (its parent's engine threads are not in it; the
            # parent holds the folder's lock): closing here waited for threads that do not
            # exist, or marked the parent's folder as cleanly exited. The parent closes it.
            return
        # An unhandled exception on the way out was printed and left in sys.last_value.
        clean = getattr(sys, "last_value", None) is None
        try:
            self.close(CLOSE_TIMEOUT_AT_EXIT, clean=clean)
        except CheckpointError as exc:
            log.error("at exit: %s", exc)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(clean=exc_type is None)

    directory = property(lambda self: self._storage.root)  # the primary tier's Path

    @property
    def staging_bytes(self) -> int:
        """Host memory the staging pool holds now (its budget is ``config.staging_bytes``)."""
        return self._pipeline.pool.capacity_bytes

    @property
    def next_version(self) -> int:
        """The number the next version will get."""
        return self._next_version

    def restarted_empty(self) -> None:
        """No version was loaded: if earlier writers of this directory died before a first
        commit, training restarts from step 0 after a failure (tell the policy)."""
        self._taken_over = True  # nothing to restore: no version there is another run's
        if self._storage.starts.number > 1:
            self.resumed(0, written=None)


def _step_pre_hook(engine: weakref.ref[Checkpointer], *_: Any) -> None:
    checkpointer = engine()
    if checkpointer is not None:
        checkpointer._step_pre_hook()


def _step_post_hook(engine: weakref.ref[Checkpointer], *_: Any) -> None:
    checkpointer = engine()
    if checkpointer is not None:
        checkpointer._step_post_hook()


_ENGINE = os.path.dirname(os.path.abspath(__file__))  # pcframe/


def _outside_engine(frame: FrameType) -> FrameType:
    """The innermost frame of ``frame``'s stack outside pcframe (the code that called it)."""
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_ENGINE):
        frame = frame.f_back
    return frame


def _quietly(undo: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        undo()


def _versions_text(versions: Sequence[int]) -> str:
    if len(versions) == 1:
        return f"version {versions[0]}"
    return f"versions {min(versions)}-{max(versions)}"
