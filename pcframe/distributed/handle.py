"""``DistributedSaveHandle``: a version on its way to being global.

The :class:`~pcframe.save.handle.VersionHandle` of a global version: it is committed only
once every rank's shard is durable and rank 0 published it (see
:mod:`pcframe.distributed.protocol`).
"""

from __future__ import annotations

import time

from pcframe.distributed.protocol import Round
from pcframe.errors import CheckpointError, SaveError
from pcframe.save.handle import VersionHandle
from pcframe.save.status import SaveStatus, Stage


class DistributedSaveHandle(VersionHandle):
    """A version on its way to being global; its ``status`` is ``IN_FLIGHT`` until the
    round is decided, then where the global version stands."""

    def __init__(self, round_: Round) -> None:
        super().__init__(round_)
        self._round = round_

    def done(self) -> bool:
        return self._round.decided.is_set()

    def wait(self, timeout: float | None = None) -> SaveStatus:
        """Block until the version's round is decided; return the global version's status.

        ``COMMITTED`` when the version became global, ``DISCARDED`` when a newer one was
        first. A failure of this rank's own shard is (also) raised by the checkpointer's
        next ``save()``/``wait()``/``close()``.

        Raises:
            RanksOutOfStep: the ranks did not save the same version at the same step.
            SaveError: the version did not become global (stage ``round``; the message says
                why, e.g. which rank failed).
            TimeoutError: if ``timeout`` passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        meeting = self._round.meeting
        if meeting is not None:  # the ranks out of step is the first thing to tell
            if not meeting.done(timeout):
                raise TimeoutError(f"version {self.version}: ranks not all met after {timeout}s")
            meeting.result()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._round.decided.wait(left):
            raise TimeoutError(f"version {self.version} not decided after {timeout}s")
        status = self._round.status
        if status is SaveStatus.FAILED:
            cause = CheckpointError(f"not global: {self.reason}")
            raise SaveError(self.version, self.step, Stage.ROUND, cause)
        return status

    @property
    def reason(self) -> str:
        """Why the version did not become global ("" if it did or is undecided)."""
        return self._round.reason

    def __repr__(self) -> str:
        state = "undecided"
        if self.done():
            state = "global" if self._round.published else "not global"
        return f"DistributedSaveHandle(version={self.version}, step={self.step}, {state})"
