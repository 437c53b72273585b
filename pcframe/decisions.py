"""The interval policy's side of the engine: when to save, and what the policy is told.

:class:`Decisions` asks the policy at each step (:meth:`Decisions.decide`) with the loop's
measurements (:class:`~pcframe.feed.PolicyFeed`) and the pending preemption notice (its
notice sources polled), checks the answer, and tells the policy what each save cost and
when training resumed. The :class:`~pcframe.checkpointer.Checkpointer` acts on the answer
(how a version is saved is the :mod:`pcframe.save` room's); the trace-driven simulator
drives the same policies through the same feed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pcframe.errors import ConfigError
from pcframe.feed import PolicyFeed, earliest_notice, policy_notice, process_age
from pcframe.policies.base import (
    Decision,
    IntervalPolicy,
    Notice,
    PolicyContext,
    Restarted,
    SaveCompleted,
    checked_decision,
)
from pcframe.policies.notices.base import NoticeSource
from pcframe.save.handle import SaveRecord
from pcframe.save.progress import COST_KEY, SaveProgress
from pcframe.store.starts import Starts
from pcframe.store.tiers import Tiers

log = logging.getLogger("pcframe")


def checked_notices(notices: Any) -> list[NoticeSource]:
    """``notices`` as a list of notice sources (one source, or a sequence of them).

    Raises:
        ConfigError: anything else (``notices="SIGTERM"`` failed at the first poll, in a
            callback once the fit had started), naming the fix.
    """
    if notices is None:
        return []
    sources = [notices] if isinstance(notices, NoticeSource) else notices
    if (
        isinstance(sources, str | bytes)
        or not isinstance(sources, Sequence)
        or not all(isinstance(source, NoticeSource) for source in sources)
    ):
        raise ConfigError(
            f"notices={notices!r}: give notice sources, e.g. "
            "notices=[SignalNoticeSource(signals=['SIGTERM'])] (pcframe.policies)"
        )
    return list(sources)


class Decisions:
    """One engine's interval policy, its notice sources and its feed.

    Attributes:
        notice: the pending preemption notice, as last seen by :meth:`decide`.
        last: the policy's (checked) answer at the last :meth:`decide`.
        last_step_seen: the newest step :meth:`decide` was asked about.
    """

    def __init__(self, policy: IntervalPolicy, notices: Sequence[NoticeSource]) -> None:
        self.policy = policy
        self.notices = checked_notices(notices)
        self.feed = PolicyFeed()
        self.notice: Notice | None = None
        self.last: Decision | None = None
        self.last_step_seen: int | None = None

    def decide(
        self,
        step: int,
        notice: Notice | None,
        tiers: Tiers,
        occupancy: Mapping[str, int],
    ) -> Decision:
        """Measure the iteration, poll the notice sources (unless ``notice`` is given), ask
        the policy and record its answer and the pending notice."""
        now = time.monotonic()
        self.feed.stepped(step, now)
        self.last_step_seen = step
        notice = notice or earliest_notice(self.notices, now)
        context = self.context(step, now, notice, tiers, occupancy)
        self.last = decision = checked_decision(self.policy, self.policy.decide(context))
        if notice is None:  # the policy's own source (NoticeDriven(inner, source)), after it
            # decided: a notice it answered without a save is pending all the same (the
            # engine secures the newest version then, and the loop sees ``ckpt.notice``)
            notice = policy_notice(self.policy, now)
        self.notice = notice
        return decision

    def context(
        self,
        step: int,
        now: float,
        notice: Notice | None,
        tiers: Tiers,
        occupancy: Mapping[str, int],
    ) -> PolicyContext:
        """What the policy sees at ``step`` (the tiers' write times estimated from the
        measured time to durable)."""
        return self.feed.context(
            step,
            now,
            notice=notice,
            tier_write_times=tiers.write_times(self.feed.save_duration),
            wall_time=time.time(),
            **occupancy,
        )

    def saved(self, step: int) -> None:
        """A save of ``step`` started; the training thread is free again now."""
        self.feed.saved(step, time.monotonic())

    def committed(self, progress: SaveProgress, record: SaveRecord) -> None:
        """A version became durable: the feed and the policy learn what it cost."""
        self.feed.committed(record.stall, record.durable)
        at, cost = time.monotonic(), (record.stall, record.durable, progress.nbytes)
        self.policy.observe(SaveCompleted(progress.version, progress.step, at, *cost))

    def resumed(
        self, step: int, written: Mapping[str, Any] | None, starts: Starts, clean: bool
    ) -> None:
        """Training goes on from ``step`` (``written``: the loaded manifest's ``engine``
        section, naming its writer; ``None``: nothing was loaded)."""
        if written is not None:
            self.feed.resumed(step, process_age())
            completion = recorded_completion(written, step, time.monotonic())
            if completion is not None:
                self.policy.observe(completion)
        unseen = starts.unseen(written)
        self.policy.observe(Restarted(time.monotonic(), process_age(), step, clean, unseen))

    def unsaved_step(self) -> int | None:
        """The newest step seen, if no save started at or after it (for ``save_last``)."""
        step, last = self.last_step_seen, self.feed.last_save_step
        return step if step is not None and (last is None or step > last) else None

    def close(self) -> None:
        """Close the policy (e.g. restore its signal handlers) and the notice sources, in
        that order: each of them whatever the ones before raise (a user's policy whose
        close() raised left the sources' signal handlers in place), the first error raised
        once all are closed."""
        with contextlib.ExitStack() as stack:  # runs its callbacks last-pushed first
            for source in reversed(self.notices):
                stack.callback(source.close)
            close_policy = getattr(self.policy, "close", None)
            if callable(close_policy):
                stack.callback(close_policy)


def recorded_completion(written: Mapping[str, Any], step: int, at: float) -> SaveCompleted | None:
    """The completion of the save that wrote the restored version, from the costs its
    manifest records (:meth:`SaveProgress.cost_record`): the policy state it holds was taken
    when that save started, so the policy never saw it finish. ``None`` where the version
    records none (an older writer) or records values no save has."""
    record = written.get(COST_KEY)
    if record is None:
        return None
    try:
        version, nbytes = int(record["version"]), int(record["nbytes"])
        stall, durable = float(record["stall"]), float(record["durable"])
    except (TypeError, KeyError, ValueError):
        version, stall = -1, math.nan
    if version < 1 or nbytes < 0 or not all(math.isfinite(x) and x >= 0 for x in (stall, durable)):
        log.warning(
            "the restored version's manifest records its save's cost as %.120r; ignored (the "
            "policy learns the costs from this process's saves instead)",
            record,
        )
        return None
    return SaveCompleted(version, step, at, stall, durable, nbytes)
