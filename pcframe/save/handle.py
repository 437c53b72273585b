"""What a save returns to the user: a handle to wait on, and a record of what it cost."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from pcframe.errors import SaveError
from pcframe.runtime.threads import check_timeout
from pcframe.save.progress import SaveProgress
from pcframe.save.status import SaveStatus


@dataclass
class SaveRecord:
    """What one save cost, as measured."""

    version: int
    step: int
    nbytes: int
    status: SaveStatus = SaveStatus.IN_FLIGHT
    stall: float = 0.0  # seconds the training thread was blocked by this save
    copy: float = 0.0  # seconds of the snapshot copy into staging
    cpu: float = 0.0  # CPU seconds the engine's threads spent on it (all stages, all threads)
    durable: float = 0.0  # seconds from save() to committed (0 unless committed)
    stage: str = ""
    error: str = ""


class VersionHandle(ABC):
    """What ``save()`` returns at either front door: a version on its way.

    ``version``, ``step``, ``status``; ``done()``; ``wait()``, which returns the final
    :class:`SaveStatus` and raises :class:`SaveError` if the version failed.
    :class:`SaveHandle` (one process) and :class:`pcframe.distributed.DistributedSaveHandle`
    (a global version) implement it over what tracks their version (``tracked``: anything
    with ``version``, ``step`` and ``status``).
    """

    def __init__(self, tracked: Any) -> None:
        self._tracked = tracked

    @property
    def version(self) -> int:
        return self._tracked.version

    @property
    def step(self) -> int:
        return self._tracked.step

    @property
    def status(self) -> SaveStatus:
        return self._tracked.status

    @abstractmethod
    def done(self) -> bool:
        """Whether the version's outcome is known (``wait`` would not block)."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> SaveStatus:
        """Block until the version's outcome is known; return its status."""


class SaveHandle(VersionHandle):
    """A checkpoint version on its way to disk (:class:`VersionHandle`)."""

    def __init__(self, progress: SaveProgress) -> None:
        super().__init__(progress)
        self._progress = progress

    def done(self) -> bool:
        return self._progress.finished.is_set()

    def wait(self, timeout: float | None = None) -> SaveStatus:
        """Block until the version is committed, discarded or failed; return that status.

        Raises:
            SaveError: if the version failed (the engine will not raise it a second time).
            TimeoutError: if ``timeout`` passed first.
        """
        status, error = self.outcome(timeout)
        if error is not None:
            self.claim_report()
            raise error
        return status

    def outcome(self, timeout: float | None = None) -> tuple[SaveStatus, SaveError | None]:
        """Wait as :meth:`wait` does; return the status and the failure instead of raising.

        Raises:
            TimeoutError: if ``timeout`` passed first.
        """
        check_timeout(timeout, "SaveHandle.wait")
        progress = self._progress
        if not progress.finished.wait(timeout):
            raise TimeoutError(f"checkpoint version {self.version} not durable after {timeout}s")
        if progress.error is not None:
            stage = progress.stage or ""
            error = SaveError(
                self.version, self.step, stage, progress.error, progress.committed_before
            )
            return SaveStatus.FAILED, error
        return progress.status, None

    def claim_report(self) -> bool:
        """Mark the failure raised; True if nothing had raised it yet (the engine's next
        call will not raise it again)."""
        return self._progress.claim_report()

    def __repr__(self) -> str:
        return f"SaveHandle(version={self.version}, step={self.step}, status={self.status})"
