"""Retention: which committed versions may be deleted, decided in one place.

Every reason to keep a version is a :class:`KeepReason` composed into one
:class:`Retention` when the engine is built: the newest ``keep_last`` versions, what each
storage tier's placement keeps and what replicas still have to copy, the versions a
multi-rank global version needs. After those, every *dependency* is closed over: a kept
version (or one in flight) that is a delta keeps its whole base chain (:class:`KeepBases`).

:meth:`Retention.apply` is the only code that deletes committed versions. It deletes newest
first, so a crash between two deletions never leaves a listed delta version whose base is
already gone: a base is always deleted after every version that depends on it. The newest
good committed version is never deleted, nor one a restore found damaged but could not set
aside (it counts as no kept version: :meth:`Retention.kept`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from pcframe.runtime.faults import crash_point
from pcframe.store.directory import WritableCheckpointDir

log = logging.getLogger("pcframe")


class KeepReason(Protocol):
    """One reason to keep versions: ``keep(committed)`` names those it needs (oldest first in)."""

    def keep(self, committed: Sequence[int]) -> set[int]: ...


class KeepBases(Protocol):
    """A dependency: the versions that the given kept versions (and any in flight) read."""

    def needed_by(self, kept: set[int]) -> set[int]: ...


class KeepLast:
    """The newest ``count`` committed versions."""

    def __init__(self, count: int) -> None:
        self.count = count

    def keep(self, committed: Sequence[int]) -> set[int]:
        return set(committed[-self.count :]) if self.count > 0 else set()


class KeepWhere:
    """A reason given as a function (e.g. a tier set's or a commit protocol's ``keep``)."""

    def __init__(self, name: str, keep: Callable[[Sequence[int]], set[int]]) -> None:
        self.name, self._keep = name, keep

    def keep(self, committed: Sequence[int]) -> set[int]:
        return self._keep(committed)


class Retention:
    """All reasons to keep versions of one directory, and the one place that deletes.

    Args:
        storage: the directory whose committed versions are retained.
        reasons: the keep reasons (at least :class:`KeepLast`).
        bases: dependencies closed over after the reasons (delta chains).
    """

    def __init__(
        self,
        storage: WritableCheckpointDir,
        reasons: Sequence[KeepReason],
        bases: Sequence[KeepBases] = (),
    ) -> None:
        self.storage = storage
        self.reasons: list[KeepReason] = list(reasons)
        self.bases: list[KeepBases] = list(bases)
        self._lock = threading.Lock()

    def add(self, reason: KeepReason) -> None:
        """Compose one more reason (before saving starts; e.g. a multi-rank protocol)."""
        self.reasons.append(reason)

    def kept(self, committed: Sequence[int]) -> set[int]:
        """The versions of ``committed`` (oldest first) that some reason keeps.

        A version a restore found damaged and could not set aside (``storage.damaged``) is
        no version to keep: the reasons count the others only (else it took the place of a
        good one, which was pruned), and it is kept as it lies, for inspection, as a version
        set aside would be.
        """
        damaged = self.storage.damaged
        good = [v for v in committed if v not in damaged]
        keep = set(good[-1:])  # the newest good version is never deleted
        for reason in self.reasons:
            keep |= reason.keep(good)
        for dependency in self.bases:
            keep |= dependency.needed_by(keep)
        return keep | (damaged & set(committed))

    def deletable(self) -> list[int]:
        """Committed versions no reason keeps, newest first (the order they are deleted in)."""
        committed = self.storage.committed_versions()
        keep = self.kept(committed)
        return sorted((v for v in committed if v not in keep), reverse=True)

    def apply(self) -> list[int]:
        """Delete every deletable version, dependents before their bases; return them.

        A version that cannot be deleted (an I/O error) stops the sweep: older versions may be
        its bases, so they wait for the next commit, which retries from the top.
        """
        deleted = []
        with self._lock:
            for old in self.deletable():
                crash_point("retention")
                try:
                    self.storage.delete(old)
                except OSError as exc:  # the new version is committed; retry next time
                    log.warning("could not delete old checkpoint version %d: %s", old, exc)
                    break
                deleted.append(old)
        return deleted
