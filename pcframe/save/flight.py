"""The versions in flight, seen from the training thread: slots, the optimizer gate, reports,
and the handles ``save()`` returns.

At most ``max_in_flight`` versions are between ``save()`` and their end (committed,
discarded or failed); waiting for one of them to end is the backpressure a training loop
feels. A slot is not a token a save holds: it is a version started and not finished, so an
interrupt anywhere in ``save()`` (Ctrl-C, a signal handler's ``sys.exit()``) cannot leave
one taken, and ``close()`` waits for the versions the pipeline has, never for a save that
did not start. The optimizer step pre-hook (:meth:`InFlight.gate`) waits only for snapshot
copies. Finished versions are handed over by the commit thread and reported on the
training thread at its next engine call: records updated, the policy told, and the first
unreported failure raised.

Waiting on a handle is an engine call of its thread (:mod:`pcframe.runtime.threads`): a
signal handler's ``wait()`` in the middle of another engine call returns at once and waits
once that call has returned (:class:`EngineSaveHandle`, :class:`DeferredSave`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pcframe.errors import CheckpointError, SaveError
from pcframe.runtime.collector import collector_paused
from pcframe.runtime.interrupts import interrupts_held, on_main_thread
from pcframe.runtime.threads import (
    Bell,
    DeferredCall,
    EngineCalls,
    Reentry,
    check_timeout,
    engine_call,
)
from pcframe.save.handle import SaveHandle, SaveRecord, VersionHandle
from pcframe.save.progress import SaveProgress
from pcframe.save.status import SaveStatus, Stage

if TYPE_CHECKING:
    from pcframe.save.capture import Capture
    from pcframe.save.pipeline import SavePipeline

log = logging.getLogger("pcframe")
SUMMARY_EVERY = 60.0  # seconds between INFO lines summing up commits


class InFlight:
    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.records: dict[int, SaveRecord] = {}
        # Rung (notified) when a version finishes: the training thread waits on the bell,
        # which no other thread acquires (pcframe.runtime.threads.Bell), other threads on
        # the condition.
        self._ended_bell = Bell()
        self._ended = threading.Condition()
        self._finished: list[SaveProgress] = []
        self._finished_lock = threading.Lock()
        # The lists a save appends to while the gate or a report prunes them (another thread
        # may save): appends and prunes under the lock, so no append is lost to a prune's
        # write-back (a snapshot the gate then would not wait for: a torn one). Pruned into
        # new lists, so a reader iterating without the lock sees one list or the other.
        self._lists_lock = threading.Lock()
        # One report at a time: each failure raised once, the policy told of each commit once
        # (re-entrant: the policy's observe() may report through an engine call of its own).
        self._reporting = threading.RLock()
        self._copying: list[SaveProgress] = []  # snapshot copy not yet done
        self.steps = 0  # optimizer steps the gate has seen (the state is sized after one)
        self._unfinished: list[SaveProgress] = []  # not yet reported as finished
        self._unraised: list[SaveProgress] = []  # failed, finished, not raised yet
        self._commits, self._summary_at = 0, None  # for the periodic INFO line
        # Failures found on other threads after a version committed (its placement policy's,
        # in the tiers): f(reported) -> one whose version ``reported`` says was reported
        # here, taken (so raised once), or None. Raised as a failed version's error is.
        self.late_failures: list[Callable[[Callable[[int], bool]], BaseException | None]] = []
        # How the training thread waits for snapshot copies (the pipeline's
        # wait_for_copies: it helps copy, and the writers let the copy go first).
        self.wait_for_copies: Callable[[Sequence[SaveProgress]], None] = _wait_each

    # --- training thread ---------------------------------------------------------------

    def acquire(self) -> None:
        """Wait for a free slot: fewer than ``max_in_flight`` versions in flight.

        Nothing is taken: the version :meth:`start` starts is the slot. Only one caller at
        a time saves (``Checkpointer.save`` is serialized), so no other save takes the slot
        between this check and that start.
        """
        self.wait_until(lambda: self.count() < self.max_in_flight, None)

    def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``ready()`` (it changes when a version finishes); False if ``timeout``
        seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            # In slices as well: a version finished by a path that did not ring (none known)
            # costs a second, not the run.
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if left <= 0:
                return False
            if on_main_thread():
                self._ended_bell.wait(left)
            else:
                with self._ended:
                    if not ready():
                        self._ended.wait(left)
        return True

    def wait_finished(self, progress: SaveProgress, timeout: float | None) -> bool:
        """Wait until ``progress``'s version has finished; False if ``timeout`` passed."""
        return self.wait_until(progress.finished.is_set, timeout)

    def start(
        self,
        capture: Capture,
        pipeline: SavePipeline,
        version: int,
        step: int,
        metadata: dict[str, Any],
        entered: float,
    ) -> SaveProgress:
        """Start one version in the slot :meth:`acquire` found free: capture the state, hand
        it to ``pipeline``.

        A version the pipeline refused (or an interrupt cut short after it was recorded) is
        finished as failed, so ``close()`` never waits for a version that did not start.
        ``entered``: when ``save()`` was called (the version's stall starts there).
        """
        progress: SaveProgress | None = None
        handed = False
        try:  # one try from the capture to the hand-off: an interrupt anywhere is undone
            with collector_paused():  # no full collections set off by the capture's objects
                request = capture.request(version, step, metadata)
                progress = SaveProgress(version, step, request.nbytes, entered)
                # The hand-off takes locks the pipeline's threads take (the staging pool's):
                # a signal handler's exception there is raised once it is over.
                with interrupts_held():
                    self.started(progress)
                    pipeline.submit(request, progress)
                    handed = True
                del request  # the pipeline holds the snapshot's sources only while it needs them
        except BaseException as exc:  # e.g. a staging pool that cannot be allocated
            if not handed and progress is not None and progress.version in self.records:
                self.abandon(progress, exc)  # finished as failed: its slot is free again
            raise
        return progress

    def started(self, progress: SaveProgress) -> None:
        # The record first: start() undoes a version it lists (abandon: its events set).
        self.records[progress.version] = SaveRecord(
            progress.version, progress.step, progress.nbytes
        )
        with self._lists_lock:
            self._unfinished.append(progress)
            self._copying.append(progress)

    def count(self) -> int:
        """Versions started and not yet finished."""
        return sum(1 for p in self._unfinished if not p.finished.is_set())

    def occupancy(self) -> dict[str, int]:
        """``in_flight`` and ``max_in_flight`` as the policy's context takes them."""
        return {"in_flight": self.count(), "max_in_flight": self.max_in_flight}

    def copying(self) -> bool:
        """Whether a started version's snapshot is still being copied."""
        return any(not p.copy_done.is_set() for p in self._copying)

    def gate(self, *_: Any, count: bool = True) -> None:
        """Optimizer step pre-hook: wait for in-flight snapshots of the weights it will change
        (``count=False``: a second wait in the same step, not another step)."""
        if count:
            self.steps += 1
        still = [p for p in self._copying if not p.copy_done.is_set()]
        if still:
            start = time.perf_counter()
            self.wait_for_copies(still)
            still[-1].stall += time.perf_counter() - start
        self._prune()

    def wait_all(self, timeout: float | None = None) -> bool:
        """Block until every version started so far has finished (all slots free).

        Returns False if ``timeout`` seconds passed first.
        """
        waiting = list(self._unfinished)
        return self.wait_until(lambda: all(p.finished.is_set() for p in waiting), timeout)

    def in_flight_versions(self) -> list[int]:
        return [p.version for p in self._unfinished if not p.finished.is_set()]

    def report(self, committed: Callable[[SaveProgress, SaveRecord], None]) -> None:
        """Update the records of finished versions; ``committed`` is called for each commit.

        Raises:
            SaveError: for the first failed version not yet raised (by its handle or here).
            PolicyError: else, a failure found after a commit (:attr:`late_failures`): the
                placement policy of a version that stands committed in the primary.
        """
        with self._reporting:  # engine calls of two threads (a save, a wait) report at once
            self._report(committed)

    def _report(self, committed: Callable[[SaveProgress, SaveRecord], None]) -> None:
        with self._finished_lock:
            finished, self._finished = self._finished, []
        self._prune()
        errors = self._unraised  # failures an earlier call found after the one it raised
        for progress in finished:
            record = self.records[progress.version]
            record.status, record.stall = progress.status, progress.stall
            record.copy, record.cpu = progress.copy_seconds, progress.cpu_seconds
            if progress.status == SaveStatus.COMMITTED:
                record.durable = progress.durable_at - progress.started
                committed(progress, record)
                self._summarise(progress, record)
            elif progress.error is not None:
                record.stage, record.error = progress.stage or "", str(progress.error)
                if not progress.reported:
                    errors.append(progress)
        first = next((p for p in errors if p.claim_report()), None)
        # Each failure is raised once, one per call: those after the first wait for the next.
        self._unraised = [p for p in errors if not p.reported]
        if first is not None:
            assert first.error is not None
            raise SaveError(
                first.version, first.step, first.stage or "", first.error, first.committed_before
            ) from first.error
        for take in self.late_failures:  # after the version's commit is counted above
            late = take(self._reported)
            if late is not None:
                raise late

    def _reported(self, version: int) -> bool:
        """Whether ``version``'s end was reported (or it is not one of this engine's)."""
        record = self.records.get(version)
        return record is None or record.status is not SaveStatus.IN_FLIGHT

    def _prune(self) -> None:
        """Drop the versions whose copy is done from ``_copying``, the finished ones from
        ``_unfinished``: under the lock :meth:`started` appends under."""
        with self._lists_lock:
            self._copying = [p for p in self._copying if not p.copy_done.is_set()]
            self._unfinished = [p for p in self._unfinished if not p.finished.is_set()]

    def _summarise(self, progress: SaveProgress, record: SaveRecord) -> None:
        """One INFO line at the first commit, then at most one per :data:`SUMMARY_EVERY`."""
        self._commits += 1
        now = time.monotonic()
        if self._summary_at is not None and now - self._summary_at < SUMMARY_EVERY:
            return
        self._summary_at = now
        log.info(
            "committed version %d (step %d): %.1f MB, stall %.1f ms, durable after %.2f s; "
            "%d versions committed by this engine",
            progress.version,
            progress.step,
            progress.nbytes / 1e6,
            record.stall * 1e3,
            record.durable,
            self._commits,
        )

    def abandon(self, progress: SaveProgress, exc: BaseException) -> None:
        """A save that failed before the pipeline took it: finished, failed, slot freed.

        The caller raises ``exc`` itself, so it is marked reported (not raised twice).
        """
        progress.fail(Stage.SNAPSHOT, exc)
        progress.status, progress.reported = SaveStatus.FAILED, True
        progress.copy_done.set()
        self.finished(progress)  # which sets ``finished`` once the version is listed

    # --- commit thread -----------------------------------------------------------------

    def finished(self, progress: SaveProgress) -> None:
        """Hand a finished version over to the training thread, then set its ``finished``;
        a save waiting for a slot looks again."""
        with self._finished_lock:
            self._finished.append(progress)
        # Listed before it is finished: a wait() that sees it finished reports it (raises
        # its failure, records its status) instead of returning before it is listed.
        progress.finished.set()
        self._ended_bell.ring()
        with self._ended:
            self._ended.notify_all()


def _wait_each(progresses: Sequence[SaveProgress]) -> None:
    for progress in progresses:
        progress.copy_done.wait()


class EngineSaveHandle(SaveHandle):
    """The :class:`SaveHandle` a ``Checkpointer`` returns: waiting on it is an engine call
    of its thread (:mod:`pcframe.runtime.threads`).

    So a signal handler's ``save()`` that lands while the training thread waits on a handle
    runs once that wait has returned, instead of inside it; and a handler's ``wait()`` in
    the middle of an engine call returns at once (the status so far, never raising: the
    engine raises a failure at its next call) and waits when that call has returned.
    """

    def __init__(self, progress: SaveProgress, calls: EngineCalls, flight: InFlight) -> None:
        super().__init__(progress)
        self._engine_calls, self._flight = calls, flight

    @engine_call(reentry=Reentry.DEFERRED, owner="SaveHandle", name="wait", later="_wait_later")
    def outcome(self, timeout: float | None = None) -> tuple[SaveStatus, SaveError | None]:
        check_timeout(timeout, "SaveHandle.wait")
        return self._outcome(timeout)

    def wait_here(self) -> SaveStatus:
        """:meth:`wait` inside the engine call that made the version (an emergency save
        that ``maybe_save`` waits for): not a call of its own."""
        status, error = self._outcome(None)
        if error is not None:
            self.claim_report()
            raise error
        return status

    def _outcome(self, timeout: float | None) -> tuple[SaveStatus, SaveError | None]:
        # Not the version's Event: the training thread waits on the flight's bell
        # (pcframe.runtime.threads.Bell), and reads the fields the commit thread set
        # before ``finished``.
        if not self._flight.wait_finished(self._progress, timeout):
            raise TimeoutError(f"checkpoint version {self.version} not durable after {timeout}s")
        progress = self._progress
        if progress.error is not None:
            stage = progress.stage or ""
            error = SaveError(
                self.version, self.step, stage, progress.error, progress.committed_before
            )
            return SaveStatus.FAILED, error
        return progress.status, None

    def _wait_later(self, timeout: float | None = None) -> tuple[SaveStatus, SaveError | None]:
        # No wait at all here: the interrupted call may be in the middle of one.
        if not self._progress.finished.is_set():
            self._engine_calls.defer("SaveHandle.wait", functools.partial(self.wait, timeout))
        return self._progress.status, None


class DeferredSave(VersionHandle):
    """What ``save()`` returns when it is called (by a signal handler, or a callback) while
    another engine call runs on its thread: the save starts once that call has returned.

    ``version`` is 0 until then; ``status`` is ``IN_FLIGHT`` until the version has an
    outcome (``FAILED`` if the save could not start: ``wait()`` raises why). ``wait()`` on
    the thread that made it, once nothing of the engine runs there, starts what was
    deferred first; in the middle of another engine call it returns the status at once.
    """

    def __init__(self, call: DeferredCall, step: int, calls: EngineCalls) -> None:
        super().__init__(None)
        self._call, self._step, self._engine_calls = call, step, calls

    @property
    def started(self) -> SaveHandle | None:
        """The handle of the started save (None until it has started)."""
        if not self._call.done.is_set() or not isinstance(self._call.result, SaveHandle):
            return None
        return self._call.result

    @property
    def version(self) -> int:
        handle = self.started
        return handle.version if handle is not None else 0

    @property
    def step(self) -> int:
        return self._step

    @property
    def status(self) -> SaveStatus:
        if self._call.error is not None:
            return SaveStatus.FAILED
        handle = self.started
        return handle.status if handle is not None else SaveStatus.IN_FLIGHT

    def done(self) -> bool:
        handle = self.started
        return self._call.error is not None or (handle is not None and handle.done())

    @engine_call(reentry=Reentry.DEFERRED, owner="SaveHandle", name="wait", later="_wait_later")
    def wait(self, timeout: float | None = None) -> SaveStatus:
        """Block until the save has started and its version has an outcome; return it.

        Raises:
            SaveError: the version failed; or what stopped the save from starting (e.g.
                ``CheckpointError``: the engine was closed first).
            TimeoutError: ``timeout`` passed first.
        """
        check_timeout(timeout, "SaveHandle.wait")
        # Entering this call ran what this thread deferred (this save among it); a save
        # deferred on another thread is started by that thread.
        if self._call.thread == threading.get_ident() and not self._call.done.is_set():
            # Only a call made while this save's own turn runs gets here (a callback of it,
            # or of a call deferred before it): waiting would wait for itself.
            raise CheckpointError(
                f"wait() on the save of step {self._step} was called before that save could "
                "start on this thread; wait for it after the call that deferred it returns"
            )
        if not self._call.done.wait(timeout):
            raise TimeoutError(f"the save of step {self._step} did not start within {timeout}s")
        if self._call.error is not None:
            raise self._call.error
        handle = self.started
        assert handle is not None  # done without an error: save() returned its handle
        return handle.wait(timeout)

    def _wait_later(self, timeout: float | None = None) -> SaveStatus:
        if not self.done():
            self._engine_calls.defer("SaveHandle.wait", functools.partial(self.wait, timeout))
        return self.status

    def __repr__(self) -> str:
        return f"SaveHandle(version={self.version}, step={self.step}, status={self.status})"
