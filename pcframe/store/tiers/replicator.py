"""One background worker per replica tier: copies committed versions, newest first wins.

The commit thread only drops a job into a one-slot mailbox (never blocks): if a job is already
waiting, the older one is dropped (``skipped``) because a newer committed version supersedes
it. So a slow or dead tier costs at most one version being written plus one waiting, never a
growing queue, and the primary tier only has to keep those two (see :meth:`protected`).
Failed writes are retried with exponential backoff until a newer version arrives or the
retries run out. After a successful write the tier's own retention runs against the tier's
real listing: every older version not in the ``keep`` set the placement computes from that
listing is deleted, never the one just written.

A version the tier holds already is never written over. It counts as written when the
tier's copy is the primary's (the same manifest checksum): an earlier process of the run
copied it there, and this one restored it (a preemption notice then secures it at once).
Another run's version of the same number is refused (an error), as is any older one.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pcframe.errors import CorruptCheckpoint, TierCancelled, TierError
from pcframe.feed import ewma
from pcframe.format.manifest import manifest_crc
from pcframe.format.names import MANIFEST_NAME
from pcframe.runtime.threads import single_threaded_torch
from pcframe.store.tiers.base import Tier

log = logging.getLogger("pcframe.store.tiers")


@dataclass(frozen=True)
class Job:
    version: int
    step: int
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class TierStatus:
    """How far a replica tier is behind, and what went wrong (a snapshot)."""

    name: str
    location: str
    committed: tuple[int, ...] | None  # None: never listed successfully
    last_written: int | None = None
    pending: int | None = None
    in_flight: int | None = None
    written: int = 0  # versions written by this process
    skipped: int = 0  # dropped because a newer version arrived first
    abandoned: int = 0  # given up after all retries (or impossible to write)
    failures: int = 0  # failed attempts
    last_error: str = ""
    bytes_written: int = 0
    write_seconds: float | None = None  # smoothed seconds per write
    throughput: float | None = None  # smoothed bytes per second
    lag_versions: int = 0  # newest version submitted minus the newest written
    lag_seconds: float = 0.0  # age of the oldest submitted version not yet written


class Replicator:
    """Writes jobs to ``tier`` on its own thread; see the module docstring."""

    def __init__(
        self,
        tier: Tier,
        source: Callable[[int], Path],
        keep: Callable[[Job, tuple[int, ...]], set[int]],
        *,
        retries: int = 5,
        backoff: float = 0.5,
        backoff_max: float = 30.0,
        committed: Iterable[int] | None = None,
        sweep_at_start: bool = True,
    ) -> None:
        self.tier = tier
        # False: not swept when the worker starts, only after each write as always (a tier
        # left unlisted while the engine opens: Tiers.list_later). Not before the first
        # write either: a notice's cancel of an older upload would be lost during it.
        self._sweep_at_start = sweep_at_start
        self.source = source
        self.keep = keep  # (job just written, tier listing) -> versions to keep
        self.retries, self.backoff, self.backoff_max = retries, backoff, backoff_max
        self._cond = threading.Condition()
        self._pending: Job | None = None
        self._in_flight: Job | None = None
        self._newest_submitted = 0
        self._oldest_unwritten: float | None = None
        self._closing = False
        self._aborted = False
        self._hurry = False  # expedite() of the version between attempts: retry at once
        self._written_versions: set[int] = set()
        self.status_ = TierStatus(
            tier.name, tier.location, tuple(sorted(committed)) if committed is not None else None
        )
        self._thread = threading.Thread(
            target=self._run, name=f"pcframe-tier-{tier.name}", daemon=True
        )
        self._thread.start()

    # --- called from other threads -------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job``; an older job still waiting is dropped. Never blocks for long.

        A version already written here, or being written, is not queued again: a second
        write of it would first remove the copy just written (a notice's :meth:`expedite` of
        a version the routine placement had queued uploaded it twice, and the close in a
        hurry that follows a notice cut the second upload off, leaving no copy at all).
        """
        with self._cond:
            if self._closing or job.version in self._written_versions:
                return
            if self._in_flight is not None and self._in_flight.version >= job.version:
                return
            if self._pending is not None:
                if self._pending.version >= job.version:
                    return
                self.status_.skipped += 1
            self._pending = job
            self._newest_submitted = max(self._newest_submitted, job.version)
            if self._oldest_unwritten is None:
                self._oldest_unwritten = job.submitted
            self._cond.notify_all()

    def expedite(self, job: Job) -> None:
        """Queue ``job`` and abort an older write in progress (answer to a preemption notice);
        the same version waiting between two attempts is tried again at once."""
        self.submit(job)
        with self._cond:
            if self._in_flight is not None and self._in_flight.version < job.version:
                self.tier.cancel()
            elif self._in_flight is not None and self._in_flight.version == job.version:
                self._hurry = True
                self._cond.notify_all()

    def wait_for(self, version: int, timeout: float | None) -> bool:
        """Block until ``version`` is written (True), dropped or abandoned (False), or timeout."""

        def settled() -> bool:
            busy = {j.version for j in (self._pending, self._in_flight) if j is not None}
            return version in self._written_versions or version not in busy

        with self._cond:
            self._cond.wait_for(settled, timeout)
            return version in self._written_versions

    def protected(self) -> set[int]:
        """Versions the primary tier must not delete yet: waiting or being written here."""
        with self._cond:
            return {j.version for j in (self._pending, self._in_flight) if j is not None}

    def write_seconds(self) -> float | None:
        """Smoothed seconds one write to this tier took (None until one succeeded)."""
        with self._cond:
            return self.status_.write_seconds

    def committed(self) -> tuple[int, ...]:
        with self._cond:
            return self.status_.committed or ()

    def status(self) -> TierStatus:
        with self._cond:
            s = self.status_
            s.pending = self._pending.version if self._pending else None
            s.in_flight = self._in_flight.version if self._in_flight else None
            s.lag_versions = max(0, self._newest_submitted - (s.last_written or 0))
            s.lag_seconds = (
                time.monotonic() - self._oldest_unwritten if self._oldest_unwritten else 0.0
            )
            return TierStatus(**vars(s))

    def close(self, timeout: float | None) -> bool:
        """Finish queued work for up to ``timeout`` s, then abort; True if nothing was cut off."""
        self.begin_close()
        return self.finish_close(timeout)

    def begin_close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def finish_close(self, timeout: float | None) -> bool:
        self._thread.join(timeout)
        with self._cond:
            idle = self._pending is None and self._in_flight is None
        if idle:  # told to stop while waiting for work: it is on its way out
            self._thread.join(5.0)
        drained = not self._thread.is_alive()
        if not drained:
            with self._cond:
                self._aborted = True
                self._cond.notify_all()
            self.tier.cancel()
            self._thread.join(5.0)
        return drained

    # --- the worker ----------------------------------------------------------------------

    def _run(self) -> None:
        single_threaded_torch()
        if self._sweep_at_start:  # the leftovers of a process before this one
            self._sweep()
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._pending is None or self._aborted:
                    return
                job, self._pending = self._pending, None
                self._in_flight = job
            try:
                self._replicate(job)
            except Exception as exc:  # a bug must not kill the worker silently
                log.exception("tier %s: unexpected error", self.tier.name)
                self._note_error(job, exc)
            finally:
                with self._cond:
                    self._in_flight = None
                    self._cond.notify_all()

    def _note_error(self, job: Job, exc: BaseException) -> None:
        with self._cond:
            self.status_.failures += 1
            self.status_.last_error = f"version {job.version}: {type(exc).__name__}: {exc}"

    def _refresh_listing(self) -> tuple[int, ...] | None:
        try:
            listed = tuple(self.tier.committed_versions())
        except TierError as exc:
            log.warning("%s", exc)
            return None
        with self._cond:
            self.status_.committed = listed
        return listed

    def _listed(self) -> tuple[int, ...]:
        """The tier's versions as last listed (listed now if never before; () if it fails)."""
        committed = self.status_.committed
        if committed is None:
            committed = self._refresh_listing()
        return committed or ()

    def _same_copy(self, job: Job, source: Path) -> bool:
        """Whether the tier's copy of ``job``'s version is the one in the primary tier at
        ``source`` (the same manifest checksum): written by an earlier process of this run,
        whose version this one restored, not another run's of the same number."""
        try:
            return self.tier.manifest_crc(job.version) == manifest_crc(source / MANIFEST_NAME)
        except (TierError, CorruptCheckpoint, OSError) as exc:  # cannot tell: not the same
            log.warning(
                "tier %s: version %d: cannot compare its copy with the primary's: %s",
                self.tier.name,
                job.version,
                exc,
            )
            return False

    def _conflict(self, job: Job, listed: tuple[int, ...]) -> str:
        """Why ``job`` must not be written (the tier holds an equal or newer version), or ''."""
        newest = max(listed, default=0)
        if job.version <= newest:  # (a version written here never comes back: _replicate)
            return (
                f"tier {self.tier.name!r} ({self.tier.location}) already holds version {newest} "
                f">= {job.version}, probably from an earlier run; not writing over it. Fix: "
                "restore first (the Checkpointer then numbers new versions above it) or clear "
                "the tier"
            )
        return ""

    def _replicate(self, job: Job) -> None:
        attempt = 0
        while job.version not in self._written_versions:  # written once, never rewritten
            source = self.source(job.version)
            reason = "" if source.is_dir() else f"{source} is gone from the primary tier"
            listed = () if reason else self._listed()
            if job.version in listed and self._same_copy(job, source):
                log.info(
                    "tier %s holds version %d already, the primary's copy (the same manifest "
                    "checksum): not written again",
                    self.tier.name,
                    job.version,
                )
                with self._cond:
                    self._have(job)
                return
            reason = reason or self._conflict(job, listed)
            if reason:
                log.error("tier %s: version %d: %s", self.tier.name, job.version, reason)
                with self._cond:
                    self.status_.abandoned += 1
                    self.status_.last_error = f"version {job.version}: {reason}"
                return
            start = time.perf_counter()
            try:
                nbytes = self.tier.write(job.version, source, job.step)
            except TierCancelled:
                with self._cond:
                    self.status_.skipped += 1
                return
            except Exception as exc:
                attempt += 1
                self._note_error(job, exc)
                full = _out_of_room(exc)
                log.warning(
                    "tier %s: writing version %d failed (attempt %d of %d): %s%s",
                    self.tier.name,
                    job.version,
                    attempt,
                    self.retries + 1,
                    exc,
                    f"; the tier ({self.tier.location}) is full: it needs room for one "
                    "version more than it keeps, and the older versions its retention drops "
                    "once this one is written are deleted now to make room"
                    if full
                    else "",
                )
                if full:  # retention runs only after a write: without this it never would
                    self._make_room(job)
                if not self._backoff(job, attempt):
                    return
                continue
            self._written(job, nbytes, time.perf_counter() - start)
            self._retain(job)
            return

    def _backoff(self, job: Job, attempt: int) -> bool:
        """Wait before the next attempt; False if the job should be given up instead."""
        delay = min(self.backoff_max, self.backoff * 2 ** (attempt - 1))
        with self._cond:
            if attempt > self.retries:
                self.status_.abandoned += 1
                return False
            self._cond.wait_for(
                lambda: self._pending is not None or self._aborted or self._hurry, delay
            )
            self._hurry = False  # a notice wants this version: the next attempt is now
            if self._pending is not None or self._aborted:
                self.status_.skipped += 1  # a newer version supersedes this one
                return False
            return True

    def _written(self, job: Job, nbytes: int, seconds: float) -> None:
        with self._cond:
            s = self.status_
            s.written += 1
            s.bytes_written += nbytes
            s.write_seconds = ewma(s.write_seconds, seconds)
            if seconds > 0:
                s.throughput = ewma(s.throughput, nbytes / seconds)
            self._have(job)

    def _have(self, job: Job) -> None:
        """``job``'s version is in the tier (written now, or there already); under the lock."""
        s = self.status_
        self._written_versions.add(job.version)
        s.last_written = max(s.last_written or 0, job.version)
        s.committed = tuple(sorted({*(s.committed or ()), job.version}))
        if self._pending is None and job.version >= self._newest_submitted:
            self._oldest_unwritten = None
        elif self._pending is not None:
            self._oldest_unwritten = self._pending.submitted
        self._cond.notify_all()

    def _make_room(self, job: Job) -> None:
        """Delete now what :meth:`_retain` would once ``job`` is written: the versions older
        than it beyond the ones kept (the tier's newest always stays)."""
        listed = self._refresh_listing()
        if not listed:
            return
        keep = self.keep(job, listed) | {max(listed)}
        for version in [v for v in listed if v < job.version and v not in keep]:
            try:
                self.tier.delete(version)
            except Exception as exc:  # the next attempt fails again, and says so
                log.warning("tier %s: deleting version %d: %s", self.tier.name, version, exc)
        self._refresh_listing()

    def _retain(self, job: Job) -> None:
        """Per-tier retention, only after ``job`` is committed here; never deletes it."""
        listed = self._refresh_listing()
        if listed is None:
            return
        keep = self.keep(job, listed) | {job.version}
        doomed = [v for v in listed if v < job.version and v not in keep]
        for version in doomed:
            try:
                self.tier.delete(version)
            except Exception as exc:  # retried after the next write
                log.warning("tier %s: deleting version %d: %s", self.tier.name, version, exc)
        if doomed:
            self._refresh_listing()
        self._sweep()

    def _sweep(self) -> None:
        try:
            removed = self.tier.sweep()
        except Exception as exc:
            log.warning("tier %s: sweeping leftovers: %s", self.tier.name, exc)
            return
        if removed:
            log.info("tier %s: removed leftovers %s", self.tier.name, removed)


def _out_of_room(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it wraps) is a full device or quota (ENOSPC, EDQUOT)."""
    for _ in range(16):  # a chain of causes, bounded
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if exc is None:
            return False
        exc = exc.__cause__ or exc.__context__
    return False
