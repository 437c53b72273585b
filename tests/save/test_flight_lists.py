"""A save on another thread while the optimizer gate or a report prunes the versions in
flight: its version stays listed, so the next ``optimizer.step()`` waits for its snapshot's
copy (a version dropped from ``_copying`` would be torn by the step it did not wait for).

Deterministic: the save is made to land between a prune's read of a list and its write-back
(:class:`SavedDuringPrune`), and the test waits until it has appended or waits for the lock
the appends take, never for a time.
"""

from __future__ import annotations

import threading
import time

import pytest

from pcframe.save.flight import InFlight
from pcframe.save.progress import SaveProgress

PRUNED = ("_copying", "_unfinished")


class WatchedLock:
    """The flight's lock, telling when a thread finds it held (and is about to wait)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock, self.waiting = lock, threading.Event()  # set by the test per save

    def __enter__(self) -> WatchedLock:
        if not self._lock.acquire(blocking=False):
            self.waiting.set()
            self._lock.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self._lock.release()


class SavedDuringPrune(InFlight):
    """An :class:`InFlight` on which another thread starts a version (``started``, as a
    ``save()`` does) just before each write-back of a pruned list, after the prune read it."""

    def __init__(self) -> None:
        super().__init__(max_in_flight=8)
        self.wait_for_copies = lambda progresses: None  # the gate's wait is not under test
        self.saved: list[SaveProgress] = []
        self.savers: list[threading.Thread] = []
        self.armed = False

    def __setattr__(self, name: str, value: object) -> None:
        if name in PRUNED and getattr(self, "armed", False):
            self._save_meanwhile()
        super().__setattr__(name, value)

    def _save_meanwhile(self) -> None:
        lock = getattr(self, "_lists_lock", None)
        if not isinstance(lock, WatchedLock):  # code without the lock: one never held
            lock = WatchedLock(lock or threading.Lock())
            object.__setattr__(self, "_lists_lock", lock)
        decided = lock.waiting = threading.Event()
        progress = SaveProgress(len(self.records) + 1, 10, 0, 0.0)

        def save() -> None:
            self.started(progress)
            decided.set()

        saver = threading.Thread(target=save, daemon=True)
        saver.start()
        self.saved.append(progress)
        self.savers.append(saver)
        # Appended, or waiting for the prune to let go of the lock: either way, decided.
        assert decided.wait(timeout=30), "the save neither appended nor waited for the lock"

    def check_saved_listed(self) -> None:
        self.armed = False
        for saver in self.savers:
            saver.join(timeout=30)
            assert not saver.is_alive()
        assert self.saved, "no save landed in a prune"
        for progress in self.saved:
            assert progress in self._copying, f"version {progress.version}: lost from _copying"
            assert progress in self._unfinished, (
                f"version {progress.version}: lost from _unfinished"
            )
        assert self.copying()  # the next optimizer step waits for those copies
        assert self.count() == len(self.saved)


def copied_version(flight: InFlight) -> SaveProgress:
    """A version whose copy is done and that has finished: the prunes drop it."""
    done = SaveProgress(1, 0, 0, 0.0)
    flight.started(done)
    done.copy_done.set()
    done.finished.set()
    return done


@pytest.mark.parametrize("prune", ["gate", "report"])
def test_a_save_while_the_lists_are_pruned_is_kept(prune):
    flight = SavedDuringPrune()
    done = copied_version(flight)
    flight.armed = True
    if prune == "gate":
        flight.gate()
    else:
        flight.report(lambda progress, record: None)
    flight.check_saved_listed()
    assert done not in flight._copying and done not in flight._unfinished


def test_two_threads_report_one_after_the_other():
    """A loop's wait() and a watcher's save() both report finished versions: the policy was
    told of commits from two threads at once, and a failure found by one report could be
    dropped by the other's write-back of the failures not yet raised. One report at a time
    now: the second waits for the first (seen on its stack, never timed)."""
    from pcframe.runtime.collector import current_frames
    from pcframe.save.status import SaveStatus

    flight = InFlight(max_in_flight=4)
    inside: list[str] = []
    overlapped = []
    first_in = threading.Event()
    seconds: list[threading.Thread] = []

    def finish(version: int) -> None:
        progress = SaveProgress(version, version, 0, 0.0)
        flight.started(progress)
        progress.status, progress.durable_at = SaveStatus.COMMITTED, 1.0
        progress.copy_done.set()
        progress.finished.set()
        flight.finished(progress)

    def waiting_for_the_report(thread: threading.Thread) -> bool:
        frame, names = current_frames().get(thread.ident), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        return "report" in names and "_report" not in names  # at the lock

    def committed(progress: SaveProgress, record: object) -> None:
        overlapped.append(bool(inside))
        inside.append(threading.current_thread().name)
        if progress.version == 1:  # the first report holds on until the second has come
            first_in.set()
            while len(overlapped) < 2 and not (seconds and waiting_for_the_report(seconds[0])):
                time.sleep(0.001)
        inside.pop()

    finish(1)
    first = threading.Thread(target=flight.report, args=(committed,), name="loop")
    first.start()
    assert first_in.wait(30)
    finish(2)
    second = threading.Thread(target=flight.report, args=(committed,), name="watcher")
    seconds.append(second)
    second.start()
    first.join(30)
    second.join(30)
    assert overlapped == [False, False]
    assert [r.status for r in flight.records.values()] == [SaveStatus.COMMITTED] * 2
