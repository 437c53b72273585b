"""Every collective call of the training thread starts with a meeting of all ranks.

``DistributedCheckpointer``'s methods are collective: every rank calls them in the same
order, ``save()`` with the same version and step and state of the same structure. A rank
that does not (it skipped a save, saved a step later, changed its model alone, or closes
while the others save) used to meet a different collective on the other ranks, or none:
they waited ``protocol_timeout`` (30 min by default) and were then told a peer had left.

A meeting is one ``all_gather`` of a small fixed-size row per rank saying what it is doing,
so every rank reads the same rows and finds a mismatch at the same meeting, with no second
collective to name it. A mismatch is final: each rank raises :class:`RanksOutOfStep` and
enters no collective of this job again, so no rank waits for one that will not come.

A ``save()`` that fails before its state is read (``state_dict()`` raised) still meets the
others, marked undescribed: that version is lost on every rank and the next one is not.

A call that fails on one rank before its meeting (a ``maybe_save()`` whose interval or
placement policy raised there, a ``close()`` whose engine raised a placement's failure)
still meets the others, marked failed: every rank then learns each failed rank's message
(one more small collective, which every rank enters, having read the same rows) and raises
it at that call. Before, the failing rank raised alone and the others waited in the meeting
for ``protocol_timeout`` (30 min by default).

A ``save()`` whose state keeps its structure only starts its meeting: it is read by the
handle's ``wait()`` or at the next call. Waiting would add the ranks' skew (tens of ms on a
loaded machine) to every save's stall, which the training's own next collective absorbs
anyway. A save whose structure changed waits for it, since the owners are planned from it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from pcframe.distributed.peers import peers
from pcframe.errors import CheckpointError, PolicyError, RanksOutOfStep
from pcframe.text import one_line

log = logging.getLogger("pcframe")


class Call(IntEnum):
    """The collective methods whose calls must line up across ranks."""

    SAVE = 1
    MAYBE_SAVE = 2
    RESTORE = 3
    CLOSE = 4

    @property
    def method(self) -> str:
        return f"{self.name.lower()}()"


@dataclass(frozen=True)
class Doing:
    """What one rank brings to a meeting (one row of int64)."""

    call: Call
    version: int  # the version this rank's next save() gets (or is saving)
    step: int = 0
    digest: int = 0  # the state's structure (save only): names, dtypes, shapes, placements
    changed: bool = False  # the structure differs from the last one agreed on
    sharded_bytes: int = 0  # of the sharded state this rank writes (save only)
    # maybe_save: (save, emergency, a preemption notice not answered yet)
    flags: tuple[int, int, int] = (0, 0, 0)
    described: bool = True  # False: save() failed before the state was read (no digest)
    # maybe_save: this rank's pending notice's deadline, wall-clock milliseconds since the
    # epoch (-1: no notice, or one without a deadline; wall clocks, because the ranks' own
    # monotonic clocks share no origin), and the newest global version it knows (0: none)
    deadline_ms: int = -1
    newest: int = 0
    failed: bool = False  # this call failed on this rank before the meeting (its message follows)

    def row(self) -> list[int]:
        fields = [self.call, self.version, self.step, self.digest, self.changed, self.described]
        fields += [self.sharded_bytes, self.deadline_ms, self.newest, self.failed]
        return [*map(int, fields), *self.flags]

    @classmethod
    def of(cls, row: list[int]) -> Doing:
        (
            call,
            version,
            step,
            digest,
            changed,
            described,
            sharded,
            deadline,
            newest,
            failed,
            *flags,
        ) = row
        return cls(
            Call(call),
            version,
            step,
            digest,
            bool(changed),
            sharded,
            tuple(flags),
            bool(described),
            deadline,
            newest,
            bool(failed),
        )

    def describe(self) -> str:
        if self.call in (Call.SAVE, Call.MAYBE_SAVE):
            return f"in {self.call.method} of version {self.version} at step {self.step}"
        return f"in {self.call.method} before saving version {self.version}"


_WIDTH = len(Doing(Call.SAVE, 0).row())  # the same for every call, so two calls still meet


@dataclass(frozen=True)
class Met:
    """What every rank learns from a meeting that matched."""

    sharded_bytes: list[int]  # per rank
    flags: tuple[int, ...]  # each flag's maximum over the ranks
    undescribed: list[int]  # ranks whose save() failed before reading their state
    # maybe_save: the earliest deadline of any rank's notice, wall-clock seconds since the
    # epoch (None: no bound), and the newest global version every rank knew (the lowest of
    # theirs; 0: none)
    deadline: float | None = None
    newest: int = 0
    failed: list[int] = field(default_factory=list)  # ranks whose call failed before it


class Meeting:
    """A meeting started on this rank; :meth:`result` waits for it (once) and reads it."""

    def __init__(self, doing: Doing, rows: list[torch.Tensor], work: Any) -> None:
        self.doing, self._rows, self._work = doing, rows, work
        self._lock = threading.Lock()
        self._outcome: Met | CheckpointError | None = None

    def done(self, timeout: float | None = None) -> bool:
        """Whether every rank has met, waiting up to ``timeout`` seconds (None: forever)."""
        work = self._work  # None once result() has read it
        if timeout is None or self._outcome is not None or work is None:
            return True  # result() waits
        deadline = time.monotonic() + timeout
        while not work.is_completed():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def result(self) -> Met:
        """The meeting's outcome (waited for the first time).

        Raises:
            RanksOutOfStep: the ranks did not make the same call with the same state.
            CheckpointError: a rank left or did not answer within the group's timeout.
        """
        with self._lock:
            if self._outcome is None:
                try:
                    with peers(self.doing.call.name.lower()):
                        self._work.wait()
                    everyone = [Doing.of(row.tolist()) for row in self._rows]
                    self._outcome = _check_rows(self.doing, everyone)
                except CheckpointError as exc:
                    self._outcome = exc
                finally:
                    if self._outcome is not None:  # a handle may keep the meeting: not its work
                        self._work = None
            if isinstance(self._outcome, CheckpointError):
                raise self._outcome
            return self._outcome


class Meetings:
    """The meetings of one checkpointer's training thread, on its private gloo group.

    Holds the last save's meeting until it is read, and the first failure of any meeting:
    after one, no rank can agree on anything, so every later call raises it again.
    """

    def __init__(self, group: Any, world_size: int) -> None:
        self.group, self.world_size = group, world_size
        self.pending: Meeting | None = None  # the last save's meeting, not read yet
        self.broken: CheckpointError | None = None
        self._entered = 0  # the last version whose save entered its meeting

    def start(self, doing: Doing) -> Meeting:
        """Enter the meeting without waiting for the other ranks."""
        mine = torch.tensor(doing.row(), dtype=torch.int64)
        rows = [torch.empty(_WIDTH, dtype=torch.int64) for _ in range(self.world_size)]
        with peers(doing.call.name.lower()):
            work = dist.all_gather(rows, mine, group=self.group, async_op=True)
        return Meeting(doing, rows, work)

    def meet(self, doing: Doing, failure: Exception | None = None) -> Met:
        """Read the last save's meeting, then hold this one and wait for every rank.

        ``failure``: this call already failed on this rank (before its meeting); it meets
        the others all the same, marked failed.

        Raises:
            PolicyError / CheckpointError: the call failed on some rank (``failure`` here):
                every rank raises the same one line, naming each failed rank and its error.
        """
        try:
            self.settle()
        except CheckpointError:
            if failure is not None:  # no meeting can follow: the failure is not raised
                log.error("rank failure not told to the others: %s", _as_told(failure))
            raise
        met = self._read(self.start(replace(doing, failed=failure is not None)))
        if met.failed:
            raise self._told(doing, met.failed, failure)
        return met

    def _told(self, doing: Doing, failed: list[int], failure: Exception | None) -> Exception:
        """The error every rank raises for the ranks ``failed`` at this meeting: each of
        them sends its message to every rank (all ranks read the same rows, so all enter)."""
        texts: list[Any] = [None] * self.world_size
        mine = None if failure is None else _as_told(failure)
        try:
            with peers(
                f"{doing.call.name.lower()}: telling every rank of {_ranks(failed)}'s error"
            ):
                dist.all_gather_object(
                    texts, (mine, isinstance(failure, PolicyError)), group=self.group
                )
        except CheckpointError as exc:
            self.broken = exc
            raise
        where = doing.describe().removeprefix("in ")
        told = "; ".join(f"{_ranks([rank])}: {texts[rank][0]}" for rank in failed)
        message = (
            f"{where} failed on {_ranks(failed)}, so every rank raises this at that call and "
            f"the ranks stay in step (the last global version is intact): {told}"
        )
        cls = PolicyError if all(texts[rank][1] for rank in failed) else CheckpointError
        error = cls(message)
        if failure is not None:
            error.__cause__ = failure
        return error

    def for_save(self, doing: Doing) -> Met | None:
        """The save's meeting: waited for when this rank's state changed structure (the
        owners are planned from it), else only started; read by the handle's ``wait()`` or
        the next call (waiting would add the ranks' skew to the stall)."""
        self._entered = doing.version
        if doing.changed:
            return self.meet(doing)
        self.pending = self.start(doing)
        return None

    def for_failed_save(self, version: int, step: int) -> Meeting | None:
        """A save that raised: if before its meeting, meet anyway (undescribed), so the
        other ranks' meeting of this version is not left waiting."""
        if self._entered != version:
            self.pending = self.start(Doing(Call.SAVE, version, step, described=False))
        return self.pending

    def settle(self) -> None:
        """Read the last save's meeting (raises what it found)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._read(pending)

    def let_go(self) -> None:
        """Forget the group (destroyed: the checkpointer closed) and any meeting unread."""
        self.group, self.pending = None, None

    def check(self) -> None:
        """Raise the failure of an earlier meeting, if any."""
        if self.broken is not None:
            raise type(self.broken)(f"an earlier call failed, so no rank can go on: {self.broken}")

    def _read(self, meeting: Meeting) -> Met:
        try:
            return meeting.result()
        except CheckpointError as exc:  # out of step, or a rank gone: enter no collective again
            self.broken = exc
            raise


def _check_rows(doing: Doing, everyone: list[Doing]) -> Met:
    if len({(d.call, d.version, d.step) for d in everyone}) > 1:
        by_what = _ranks_by([(rank, d.describe()) for rank, d in enumerate(everyone)])
        where = "; ".join(f"{_ranks(ranks)} {what}" for what, ranks in by_what.items())
        raise RanksOutOfStep(
            f"the ranks are out of step: {where}; call every DistributedCheckpointer method "
            "on every rank in the same order, and save()/maybe_save() at the same steps; "
            "restart the job (the last global version is intact)"
        )
    by_digest = _ranks_by([(rank, d.digest) for rank, d in enumerate(everyone) if d.described])
    if len(by_digest) > 1:
        digests = ", ".join(f"{_ranks(r)}: {d:015x}" for d, r in by_digest.items())
        raise RanksOutOfStep(
            f"ranks disagree on the structure of the model/optimizer state at version "
            f"{doing.version} (state digests {digests}); plain tensors are treated as "
            "replicated (DDP), so every rank must hold the same names, dtypes and shapes; put "
            "per-rank tensors in DTensors or in a stateful object, and restart the job"
        )
    flags = tuple(max(column) for column in zip(*(d.flags for d in everyone), strict=True))
    undescribed = [rank for rank, d in enumerate(everyone) if not d.described]
    deadlines = [d.deadline_ms for d in everyone if d.deadline_ms >= 0]
    deadline = min(deadlines) / 1000.0 if deadlines else None
    newest = min(d.newest for d in everyone)
    failed = [rank for rank, d in enumerate(everyone) if d.failed]
    return Met([d.sharded_bytes for d in everyone], flags, undescribed, deadline, newest, failed)


def _as_told(exc: BaseException) -> str:
    """``exc`` as one line: a pcframe error's message, else its type and message."""
    text = one_line(exc)
    return text if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {text}"


def _ranks_by(pairs: list[tuple[int, Any]]) -> dict[Any, list[int]]:
    """``(rank, value)`` pairs as value -> the ranks that hold it, in first-seen order."""
    grouped: dict[Any, list[int]] = {}
    for rank, value in pairs:
        grouped.setdefault(value, []).append(rank)
    return grouped


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
