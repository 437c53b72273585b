"""What a preemption notice secures in a multi-rank job, within the notice's window.

A notice on any rank is told to every rank in ``maybe_save``'s meeting (with the earliest
deadline any rank's notice has, on the wall clock). Saved for, its version is an emergency
one: once global, :meth:`NoticeSecuring.secure` sends it to the fastest tiers that outlive
the node (the peer tier first, then the engine's other tiers, e.g. the object store, if time
is left). Answered without a save, :meth:`NoticeSecuring.secure_newest` secures the newest
global version every rank has, the same on every rank, within the window: the commit
rounds in flight are waited for until a share of it is left, then the ranks agree in one
bounded all-gather. The peer tier is given a version its placement skipped (or one a
restart restored) on the commit protocol's round thread, in the same order on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from pcframe.checkpointer import Checkpointer
from pcframe.distributed import global_versions
from pcframe.distributed.job_tiers import PEERS
from pcframe.distributed.meeting import Meetings
from pcframe.distributed.peers import peers
from pcframe.distributed.protocol import CommitProtocol
from pcframe.distributed.replication import PeerReplication
from pcframe.errors import CheckpointError
from pcframe.policies.base import Notice
from pcframe.runtime.checks import bounded_wait
from pcframe.store.tiers import Secured

log = logging.getLogger("pcframe")

_KEEP_GLOBALS = 64  # recent global records kept for a notice (the ranks lag a round at most)

# A notice that the policy answers without a save waits for the commit rounds in flight, but
# not for its whole window: a share of it (a quarter, 1 to 10 s) is kept for the ranks to agree
# on the version they secure and to secure it.
_AGREE_SHARE, _AGREE_MIN, _AGREE_MAX = 0.25, 1.0, 10.0
# The agreement's answers count only if every rank came to it this long before its deadline:
# then the gather ends well before the deadline (a small all-gather takes milliseconds), and
# a rank that waited sees it ended. A rank that came later makes every rank refuse the answers,
# the late one too, by the same rule on the same rows (see `_agree`).
_AGREE_MARGIN = 1.0
_STAGES = {"local": 1, "ranks": 2}  # what an undecided round waits for, as the ranks tell it


class NoticeSecuring:
    """A rank's part in securing versions on preemption notices (one per
    :class:`~pcframe.distributed.DistributedCheckpointer`).

    ``newest_global``: the newest version published in this process (or restored by it);
    ``peers_given``: the newest given to the peer tier (by the round thread only). Both are
    what a notice answered without a save secures.
    """

    def __init__(
        self,
        local: Checkpointer,
        protocol: CommitProtocol,
        world_size: int,
        control: Any,
        meetings: Meetings,
        peers: PeerReplication | None,
    ) -> None:
        self.local, self.protocol, self.world_size = local, protocol, world_size
        self.control, self.meetings, self.peers = control, meetings, peers
        self.newest_global: global_versions.GlobalRecord | None = None
        self._recent: dict[int, global_versions.GlobalRecord] = {}  # the newest records
        self.peers_given = 0
        self._unanswered: list[Any] = []  # agreements some rank did not reach in time

    @property
    def newest_version(self) -> int:
        return self.newest_global.version if self.newest_global is not None else 0

    def let_go(self) -> None:
        """The control group was destroyed: the references to it and to the agreements left
        waiting on it go (see ``DistributedCheckpointer._let_go_of_groups``)."""
        self.control = None
        self._unanswered = []

    def secure(
        self,
        version: int,
        step: int,
        deadline: float | None = None,
        note: str = "",
        to_peers: bool = True,
    ) -> Secured:
        """After an emergency version became global: its copies in the fastest tiers that
        outlive this node, within the notice's window (the peer tier first, then the local
        engine's other tiers, e.g. the object store, if time is left).

        ``deadline``: the window every rank was told of in the meeting (this rank's own
        notice may end it sooner); ``note``: why it is not the version one would expect,
        kept in the reason; ``to_peers=False``: a version the peer tier does not keep."""
        notice = self.local.notice
        own = notice.deadline if notice is not None and notice.deadline else None
        if own is not None and (deadline is None or own < deadline):
            deadline = own
        left = None if deadline is None else bounded_wait(deadline - time.monotonic())
        where: list[str] = []
        reasons: list[str] = [note]
        if self.peers is not None and to_peers:
            if self.peers.wait(version, left) and self.peers.copied(version):
                where.append(PEERS)
            else:
                reasons.append("the peer copies were not confirmed in time")
        secured = self.local.tiers.secure(version, step, _bounded(notice, deadline))
        if secured is not None:
            if secured.durable:
                where += [t for t in secured.tiers if t != self.local.tiers.primary_name]
            reasons.append(secured.reason)
        return Secured(version, tuple(where), bool(where), "; ".join(r for r in reasons if r))

    def not_global_in_time(self, version: int) -> Secured:
        """An emergency version whose round the notice's window did not see decided: nothing
        secured, and why (the round still open, named), in one ERROR line."""
        stalled = self.protocol.undecided
        waits = {"local": "this rank's shard still being written", "ranks": "the other ranks"}
        why = ""
        if stalled is not None:
            open_round, stage = stalled
            behind = "" if open_round == version else f" behind version {open_round}'s, which"
            why = f" (its round waits{behind} for {waits.get(stage, stage)})"
        reason = f"emergency version {version} was not global within the notice's window{why}"
        log.error("preemption notice: %s; nothing secured", reason)
        return Secured(version, (), False, reason)

    def to_peers(self, record: global_versions.GlobalRecord, due: bool) -> None:
        """The round thread's listener: a global version placed in the peer tier is copied."""
        if due and self.peers is not None:
            self.peers_given = record.version
            self.peers.submit(record)

    def note_global(self, record: global_versions.GlobalRecord, due: bool = False) -> None:
        """The round thread's listener: the newest global version (published in order); a
        restore's too (no round runs then)."""
        self._recent[record.version] = record
        while len(self._recent) > _KEEP_GLOBALS:
            del self._recent[min(self._recent)]
        self.newest_global = record

    def _give_peers_newest(self) -> None:
        """On the round thread, after the rounds queued before it (the same on every rank):
        the newest global version, if the peer tier was not given it (its placement skipped
        it, or this process restored it) and it is this job's (its world size)."""
        record = self.newest_global
        same_job = record is not None and record.world_size == self.world_size
        if self.peers is not None and same_job and record.version > self.peers_given:
            self.peers_given = record.version
            self.peers.submit(record)

    def secure_newest(self, wall_deadline: float | None, floor: int) -> Secured | None:
        """A notice on some rank that the policy answered without a save: the newest global
        version, once the rounds in flight are decided, goes where it outlives the VM, as an
        emergency version would, on every rank (the meeting told them all).

        ``wall_deadline``: the earliest notice's deadline on the wall clock, the same on every
        rank (``None``: no bound); ``floor``: the newest global version every rank knew at
        the meeting. The rounds in flight are waited for until a share of the window is left;
        then one all-gather, bounded by the deadline, tells every rank the newest version
        each one knows, and every rank secures the oldest of those: global on every rank, and
        the same on all (a rank's view lags by up to a round while it waits). A rank that
        does not answer in time (stuck, or gone) leaves every rank the version all knew at the
        meeting, ``floor``; a round still open, or the missing answer, is named in one
        WARNING or ERROR line and in ``last_secured.reason``.

        A version restored in this process and none published since counts as the newest.
        The peer tier is given the newest global version after the rounds in flight, on the
        round thread, if it was not given it (its placement skipped it, or a restart restored
        it): decided there, from the rounds every rank has decided alike, whatever the
        agreement's outcome on this rank; not a version restored from a job of another world
        size (its shards are not this job's ranks').
        """
        if self.peers is not None:
            self.protocol.after_rounds(self._give_peers_newest)
        deadline = monotonic(wall_deadline)
        if deadline is None:
            self.protocol.join()
        else:
            window = max(0.0, deadline - time.monotonic())
            keep = min(_AGREE_MAX, max(_AGREE_MIN, window * _AGREE_SHARE))
            self.protocol.join(max(0.0, deadline - keep - time.monotonic()))
        newest = self.newest_version
        stalled = self.protocol.undecided  # after `newest`: never a round older than it
        rows, failure = self._agree(wall_deadline, newest, stalled)
        if rows is not None:
            version = min(row[0] for row in rows)
            cause = _stall_cause(rows, version)
        else:
            version = floor
            cause = (
                f"the ranks did not agree on the version to secure within the notice's window "
                f"({failure}); securing the newest one every rank knew at the notice"
            )
        record = self._recent.get(version) if version else None
        if record is None:
            if cause:
                log.error("preemption notice: no global version secured: %s", cause)
            return None
        same_job = record.world_size == self.world_size
        if cause:
            log.log(
                logging.ERROR if rows is None else logging.WARNING,
                "preemption notice: securing global version %d (step %d): %s",
                record.version,
                record.step,
                cause,
            )
        if not same_job and self.peers is not None:
            written = f"written by a job of {record.world_size} ranks"
            cause = "; ".join(filter(None, [cause, f"not given to the peer tier ({written})"]))
        return self.secure(record.version, record.step, deadline, cause, to_peers=same_job)

    def _agree(
        self, wall_deadline: float | None, newest: int, stalled: tuple[int, str] | None
    ) -> tuple[list[list[int]] | None, str]:
        """One all-gather on the control group: every rank's newest global version, its round
        still open, if any, and when it came (wall clock). ``(rows, "")`` when every rank came
        at least ``_AGREE_MARGIN`` s before ``wall_deadline`` (``None``: no bound), else
        ``(None, why)``.

        The same answer on every rank: a rank that waits gives up at the deadline, and every
        rank that receives the rows applies the same rule to them, so a rank that came too
        late to be waited for makes every rank refuse them, itself included. (Only a gather
        slower than the margin, or wall clocks further apart, could split them.) A gather
        left waiting stays referenced (its buffers are gloo's until every rank has joined it,
        or the group is destroyed)."""
        version, stage = stalled or (0, "")
        came = int(time.time() * 1000)
        mine = torch.tensor([newest, version, _STAGES.get(stage, 0), came], dtype=torch.int64)
        rows = [torch.empty(4, dtype=torch.int64) for _ in range(self.world_size)]
        what = "maybe_save: agreeing on the version a notice secures"
        until = monotonic(wall_deadline)
        try:
            with peers(what):
                work = dist.all_gather(rows, mine, group=self.control, async_op=True)
                # Ended is looked at before the clock: a gather that ended before the
                # deadline counts even where this thread wakes after it.
                while until is not None and not work.is_completed():
                    if time.monotonic() > until:
                        self._unanswered = [w for w in self._unanswered if not w.is_completed()]
                        self._unanswered.append(work)
                        return None, "a rank did not answer in time: stuck, or gone"
                    time.sleep(0.001)
                work.wait()
        except CheckpointError as exc:  # a rank is gone: no later call can meet either
            self.meetings.broken = exc
            return None, str(exc).splitlines()[0]
        answers = [row.tolist() for row in rows]
        if wall_deadline is not None:
            late = [
                r
                for r, (*_, came) in enumerate(answers)
                if came / 1000 > wall_deadline - _AGREE_MARGIN
            ]
            if late:
                return None, f"rank(s) {_listed(late)} came too late to agree"
        return [row[:3] for row in answers], ""


def deadline_ms(notice: Notice | None) -> int:
    """What a meeting row says of this rank's pending notice: its deadline on the wall clock,
    in milliseconds since the epoch, or -1 without a notice or without a deadline to keep."""
    if notice is None or not notice.deadline:
        return -1
    left = notice.deadline - time.monotonic()
    if math.isnan(left) or left > threading.TIMEOUT_MAX:
        return -1
    return int((time.time() + left) * 1000)


def monotonic(wall: float | None) -> float | None:
    """A wall-clock time (seconds since the epoch) on this process's monotonic clock."""
    return None if wall is None else time.monotonic() + (wall - time.time())


def _bounded(notice: Notice | None, deadline: float | None) -> Notice | None:
    """The notice the local tiers secure a version within: this rank's own, ending at
    ``deadline`` if that is sooner (a rank without a notice of its own is told of the
    window of another rank's)."""
    if deadline is None or math.isnan(deadline):
        return notice
    if notice is None:
        return Notice(time.monotonic(), deadline, "another rank")
    if deadline < notice.deadline:
        return dataclasses.replace(notice, deadline=deadline)
    return notice


def _stall_cause(rows: list[list[int]], secured: int) -> str:
    """Why the version a notice secures (``secured``) may not be the newest one started: the
    rounds newer than it still open on some rank when the ranks agreed (rows: newest, open
    round's version, stage)."""
    rows = [[newest, version if version > secured else 0, stage] for newest, version, stage in rows]
    writing = [rank for rank, (_, version, stage) in enumerate(rows) if version and stage == 1]
    waiting = [rank for rank, (_, version, stage) in enumerate(rows) if version and stage == 2]
    versions = sorted({version for _, version, _ in rows if version})
    if not versions:
        return ""
    said = ", ".join(map(str, versions))
    parts = []
    if writing:
        parts.append(f"rank(s) {_listed(writing)} had not finished writing their shard")
    if waiting:
        parts.append(f"rank(s) {_listed(waiting)} were waiting for the other ranks' reports")
    return (
        f"the commit round of version {said} was not decided within the notice's window "
        f"({'; '.join(parts)}); the newest version global on every rank is secured instead"
    )


def _listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
