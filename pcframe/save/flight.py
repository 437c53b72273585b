"""The versions in flight, seen from the training thread: slots, the optimizer gate, reports.

At most ``max_in_flight`` versions are between ``save()`` and their end (committed,
discarded or failed); taking a slot is the backpressure a training loop feels. The
optimizer step pre-hook (:meth:`InFlight.gate`) waits only for snapshot copies. Finished
versions are handed over by the commit thread and reported on the training thread at its
next engine call: records updated, the policy told, and the first unreported failure raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pcframe.errors import SaveError
from pcframe.runtime.collector import collector_paused
from pcframe.save.handle import SaveRecord
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
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._finished: list[SaveProgress] = []
        self._finished_lock = threading.Lock()
        self._copying: list[SaveProgress] = []  # snapshot copy not yet done
        self.steps = 0  # optimizer steps the gate has seen (the state is sized after one)
        self._unfinished: list[SaveProgress] = []  # not yet reported as finished
        self._unraised: list[SaveProgress] = []  # failed, finished, not raised yet
        self._commits, self._summary_at = 0, None  # for the periodic INFO line
        # How the training thread waits for snapshot copies (the pipeline's
        # wait_for_copies: it helps copy, and the writers let the copy go first).
        self.wait_for_copies: Callable[[Sequence[SaveProgress]], None] = _wait_each

    # --- training thread ---------------------------------------------------------------

    def acquire(self) -> None:
        """Take a slot (blocks while ``max_in_flight`` versions are in flight)."""
        self._slots.acquire()

    def release(self) -> None:
        """Give back a slot taken for a save that did not start."""
        self._slots.release()

    def start(
        self,
        capture: Capture,
        pipeline: SavePipeline,
        version: int,
        step: int,
        metadata: dict[str, Any],
        entered: float,
    ) -> SaveProgress:
        """Start one version in the slot the caller took (:meth:`acquire`): capture the
        state, hand it to ``pipeline``.

        Each step is undone if the next fails (the slot given back, a version the pipeline
        refused finished as failed), so ``close()`` never waits for a version that did not
        start. ``entered``: when ``save()`` was called (the version's stall starts there).
        """
        progress: SaveProgress | None = None
        try:  # one try from the slot taken to the hand-off: an interrupt anywhere is undone
            with collector_paused():  # no full collections set off by the capture's objects
                request = capture.request(version, step, metadata)
                progress = SaveProgress(version, step, request.nbytes, entered)
                self.started(progress)
                pipeline.submit(request, progress)
                del request  # the pipeline holds the snapshot's sources only while it needs them
        except BaseException as exc:  # e.g. a staging pool that cannot be allocated
            if progress is not None and progress.version in self.records:
                self.abandon(progress, exc)  # finished as failed: its slot comes back
            else:
                self.release()
            raise
        return progress

    def started(self, progress: SaveProgress) -> None:
        # The record first: start() undoes a version it lists (abandon: its events set).
        self.records[progress.version] = SaveRecord(
            progress.version, progress.step, progress.nbytes
        )
        self._unfinished.append(progress)
        self._copying.append(progress)

    def count(self) -> int:
        """Versions started and not yet finished."""
        return sum(1 for p in self._unfinished if not p.finished.is_set())

    def occupancy(self) -> dict[str, int]:
        """``in_flight`` and ``max_in_flight`` as the policy's context takes them."""
        return {"in_flight": self.count(), "max_in_flight": self.max_in_flight}

    def gate(self, *_: Any) -> None:
        """Optimizer step pre-hook: wait for in-flight snapshots of the weights it will change."""
        self.steps += 1
        still = [p for p in self._copying if not p.copy_done.is_set()]
        if still:
            start = time.perf_counter()
            self.wait_for_copies(still)
            still[-1].stall += time.perf_counter() - start
        self._copying = [p for p in self._copying if not p.copy_done.is_set()]

    def wait_all(self, timeout: float | None = None) -> bool:
        """Block until every version in flight has finished (all slots free).

        Returns False if ``timeout`` seconds passed first (nothing is taken then).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        taken = 0
        try:
            for _ in range(self.max_in_flight):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._slots.acquire(timeout=left):
                    return False
                taken += 1
            return True
        finally:
            for _ in range(taken):
                self._slots.release()

    def in_flight_versions(self) -> list[int]:
        return [p.version for p in self._unfinished if not p.finished.is_set()]

    def report(self, committed: Callable[[SaveProgress, SaveRecord], None]) -> None:
        """Update the records of finished versions; ``committed`` is called for each commit.

        Raises:
            SaveError: for the first failed version not yet raised (by its handle or here).
        """
        with self._finished_lock:
            finished, self._finished = self._finished, []
        self._copying = [p for p in self._copying if not p.copy_done.is_set()]
        self._unfinished = [p for p in self._unfinished if not p.finished.is_set()]
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
            raise SaveError(first.version, first.step, first.stage or "", first.error) from (
                first.error
            )

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
        progress.finished.set()
        self.finished(progress)

    # --- commit thread -----------------------------------------------------------------

    def finished(self, progress: SaveProgress) -> None:
        """Hand a finished version over to the training thread and free its slot."""
        with self._finished_lock:
            self._finished.append(progress)
        self._slots.release()


def _wait_each(progresses: Sequence[SaveProgress]) -> None:
    for progress in progresses:
        progress.copy_done.wait()
