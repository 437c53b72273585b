"""The global commit protocol: every rank reports its shard, rank 0 publishes the version.

One *round* per version, in version order, run by one background thread per rank on a
dedicated gloo process group that nothing else uses:

1. wait until the local engine has finished the version (committed, discarded or failed);
2. ``all_gather_object`` of every rank's report (status, manifest checksum, bytes);
3. rank 0 decides: only if every rank committed the same version, and it is newer than the
   last global version, it writes ``global/vN.json`` durably (the commit point), then the
   GLOBAL pointer, then prunes records beyond ``keep_global``; it also says whether the
   version goes to the peer tier (``peers_due``);
4. ``broadcast_object_list`` of the decision, so every rank learns which global versions
   exist before its retention may delete anything older. Where nodes do not share rank 0's
   root, the leader of each other root (``writes_records``) writes the same record there,
   so every node can name the versions its shards belong to. Then the version is handed to
   the ``published`` listeners (the peer tier's copies, the object store's record).

Why a dedicated group and a thread: the rounds block until the slowest rank is durable, which
must not stall training, and collectives issued from a background thread on the job's own
(default) group could interleave differently with the training's collectives on different
ranks and deadlock or mismatch. A separate gloo group has its own connections, and only this
thread uses it, so its collectives are ordered by version on every rank. Gloo works next to
NCCL, and the reports are tiny. (The job's TCPStore would also work, but is reachable only
through private torch API and keeps stale keys across elastic restarts.)

Failure handling: a rank that dies mid-save never reports, so no record is written and the
previous global version stays the newest; the survivors' collective fails (connection reset)
or times out, the protocol marks itself broken and no later version is published by this
process. A SaveError on any rank makes that round unpublished; training goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pcframe.distributed import global_versions
from pcframe.distributed.meeting import Meeting
from pcframe.errors import CheckpointError
from pcframe.runtime.threads import single_threaded_torch
from pcframe.save.handle import SaveHandle
from pcframe.save.status import SaveStatus

log = logging.getLogger("pcframe")

_RECENT = 64  # published records rank 0 keeps in memory (to upload once whole remotely)


@dataclass(eq=False)
class Round:
    """One version's way to global durability."""

    version: int
    step: int
    started: float  # perf_counter at save()
    handle: SaveHandle | None = None
    error: BaseException | None = None  # save() itself failed on this rank
    decided: threading.Event = field(default_factory=threading.Event)
    status: SaveStatus = SaveStatus.IN_FLIGHT  # of the global version, set when decided
    reason: str = ""
    decided_at: float = 0.0
    call: float = 0.0  # seconds of the whole save() call on this rank
    local_call: float = 0.0  # of which inside the local engine's save()
    meeting: Meeting | None = None  # the save's meeting when not waited for in save()
    emergency: bool = False  # saved for a preemption notice (rank 0's placement sees it)

    @property
    def published(self) -> bool:
        """Whether the version became global."""
        return self.status is SaveStatus.COMMITTED


class CommitProtocol:
    """Runs the rounds of one rank (see module docstring)."""

    def __init__(
        self,
        root: Path,
        rank: int,
        world_size: int,
        group: Any,
        retained: list[int],
        decided_up_to: int,
        keep_global: int,
        writes_records: bool = False,
        peers_due: Callable[[int, bool], bool] | None = None,
        protect: Callable[[], Collection[int]] | None = None,
        remote_held: Callable[[], list[int]] | None = None,
    ) -> None:
        """``writes_records``: this rank leads a root other than rank 0's and keeps a copy of
        every record there; ``peers_due(version, emergency)``: rank 0's placement of a
        published version in the peer tier (``None``: never)."""
        self.root, self.rank, self.world_size = root, rank, world_size
        self.shard_dir = root / global_versions.rank_dirname(rank)
        self.keep_global = keep_global
        self.writes_records = writes_records
        self.peers_due = peers_due
        self.protect = protect  # global versions the peer tier still needs (kept)
        # The versions of this rank's shard in the object store (as its tier last listed
        # them), reported each round: rank 0 finds the newest global version every shard
        # of which is there (``remote_whole``), which each rank's tier then holds, so the
        # object store always has one whole version (each rank's own retention alone kept
        # different versions on different ranks, and no version whole).
        self.remote_held = remote_held
        self.remote_whole = 0
        self.remote_listeners: list[Callable[[int, global_versions.GlobalRecord | None], None]] = []
        self._recent: dict[int, global_versions.GlobalRecord] = {}  # rank 0: published
        # Called on the round thread with (record, to_peers) once a version is global here.
        self.published: list[Callable[[global_versions.GlobalRecord, bool], None]] = []
        self._group = group
        self._lock = threading.Lock()
        self._retained = sorted(retained)  # global versions whose records exist
        self._decided_up_to = decided_up_to  # every version <= this has had its round
        self._errors: list[BaseException] = []
        self._broken: BaseException | None = None
        self._queue: queue.Queue[Round | Callable[[], None] | None] = queue.Queue()
        self._stage: tuple[int, str] | None = None  # see `undecided`
        self._emergency = False  # of the round being decided (rank 0's placement reads it)
        self._thread = threading.Thread(target=self._loop, name="pcframe-global", daemon=True)
        self._thread.start()

    # --- used by the training thread ------------------------------------------------------

    def submit(self, round_: Round) -> None:
        self._queue.put(round_)

    def join(self, timeout: float | None = None) -> bool:
        """Block until every submitted round is decided (``timeout``: for at most that many
        seconds); whether they are."""
        if timeout is None:
            self._queue.join()
            return True
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def after_rounds(self, action: Callable[[], None]) -> None:
        """Run ``action`` on the round thread once every round submitted before it is
        decided, after that round's listeners. Every rank that queues the same actions
        between the same rounds runs them at the same point of the published versions (as
        it runs the listeners): a training thread that stopped waiting for a round may not
        act on what the listeners change meanwhile, and queues what it would do here.
        Skipped once the protocol stopped."""
        self._queue.put(action)

    @property
    def undecided(self) -> tuple[int, str] | None:
        """The round this rank's thread is in, if it has not been decided: its version and
        what it waits for (``"local"``: this rank's engine to finish the version;
        ``"ranks"``: the other ranks' reports, or rank 0's decision)."""
        return self._stage

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def forget(self, version: int) -> None:
        """A restore found global version ``version`` corrupt: it no longer counts as one of
        the retained versions, so the next publication keeps the good one before it."""
        with self._lock:
            self._retained = [v for v in self._retained if v != version]

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every submitted round to be decided."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def abandon(self, reason: str) -> None:
        """Stop taking part (this rank is leaving on an error): rounds still queued end
        unpublished without a collective, and the round thread ends after the one it is in."""
        if self._broken is None:
            self._broken = CheckpointError(reason)
        self._queue.put(None)

    def stopped(self, timeout: float) -> bool:
        """Whether the round thread has ended (waiting up to ``timeout`` s)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def let_go(self) -> None:
        """Forget the group (destroyed; the round thread has ended)."""
        assert not self._thread.is_alive()
        self._group = None

    def defer(self, error: BaseException) -> None:
        """An error the local engine raised to the training thread before a meeting (an
        earlier version's failure, which the engine raises once and the round thread then
        leaves to it): kept with the rounds' errors, for the next :meth:`raise_errors`."""
        with self._lock:
            self._errors.append(error)

    def take_errors(self) -> list[BaseException]:
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def raise_errors(self) -> None:
        """Raise the first error not yet taken; log the others."""
        errors = self.take_errors()
        for extra in errors[1:]:
            log.error("%s", extra)
        if errors:
            raise errors[0]

    @property
    def healthy(self) -> bool:
        return self._broken is None

    @property
    def retained(self) -> list[int]:
        with self._lock:
            return list(self._retained)

    # --- used by the local engine's commit thread ------------------------------------------

    def keep(self, committed: Sequence[int]) -> set[int]:
        """Retention reason of the local engine: what
        :func:`~pcframe.distributed.global_versions.retention_allowed` refuses."""
        with self._lock:
            retained, upto = list(self._retained), self._decided_up_to
        allowed = set(global_versions.retention_allowed(list(committed), retained, upto))
        return {v for v in committed if v not in allowed}

    # --- the round thread --------------------------------------------------------------------

    def _loop(self) -> None:
        single_threaded_torch()
        while (round_ := self._queue.get()) is not None:
            try:
                if not isinstance(round_, Round):  # an action queued after the rounds
                    self._act(round_)
                    continue
                self._stage = (round_.version, "local")
                report = self._outcome(round_)
                if self._broken is not None:
                    self._finish(round_, None, f"commit protocol stopped: {self._broken}")
                    continue
                try:
                    reports: list[Any] = [None] * self.world_size
                    self._emergency = round_.emergency
                    self._stage = (round_.version, "ranks")
                    dist.all_gather_object(reports, report, group=self._group)
                    box = [self._decide(round_.version, reports) if self.rank == 0 else None]
                    dist.broadcast_object_list(box, group=self._group, group_src=0)
                except Exception as exc:  # a peer died or timed out: no more global versions
                    self._broken = exc
                    with self._lock:
                        self._errors.append(
                            CheckpointError(
                                f"global commit protocol failed at version {round_.version} "
                                f"({type(exc).__name__}: {exc}); no further version becomes "
                                "global in this process; the last global version is intact"
                            )
                        )
                    self._finish(round_, None, f"commit protocol failed: {exc}")
                    continue
                self._finish(round_, box[0], "")
            finally:
                self._stage = None
                self._queue.task_done()

    def _act(self, action: Callable[[], None]) -> None:
        if self._broken is not None:
            return
        try:
            action()
        except Exception as exc:  # as a listener's: the versions stay what they are
            log.error("after the global rounds: %s", exc)

    def _outcome(self, round_: Round) -> dict[str, Any]:
        report: dict[str, Any] = {
            "rank": self.rank,
            "version": round_.version,
            "step": round_.step,
            "status": SaveStatus.FAILED,
            "manifest_crc32c": "",
            "nbytes": 0,
            "error": "",
            "remote": self.remote_held() if self.remote_held is not None else None,
        }
        if round_.error is not None or round_.handle is None:
            report["error"] = f"save() raised {type(round_.error).__name__}: {round_.error}"
            return report
        status, error = round_.handle.outcome()
        if error is not None:
            report["error"] = str(error)
            if round_.handle.claim_report():  # else the engine raised it already: once is all
                with self._lock:
                    self._errors.append(error)
            return report
        report["status"] = status
        if report["status"] == SaveStatus.COMMITTED:
            try:
                shard = global_versions.shard_ref(self.root, self.rank, round_.version, round_.step)
                report.update(manifest_crc32c=shard.manifest_crc32c, nbytes=shard.nbytes)
            except (OSError, CheckpointError) as exc:
                report.update(status=SaveStatus.FAILED, error=f"committed shard unreadable: {exc}")
        return report

    def _decide(self, version: int, reports: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0: publish ``version`` if every rank committed it. Returns the decision."""
        decision: dict[str, Any] = {
            "version": version,
            "status": SaveStatus.FAILED,
            "reason": "",
            "remote_whole": self._whole_in_remote(reports),
        }
        if any((r["version"], r["step"]) != (version, reports[0]["step"]) for r in reports):
            seen = ", ".join(f"rank {r['rank']}: v{r['version']} step {r['step']}" for r in reports)
            decision["reason"] = decision["error"] = (
                f"ranks are out of step ({seen}); call save() on every rank at the same steps"
            )
            return decision
        missing = [r for r in reports if r["status"] != SaveStatus.COMMITTED]
        if missing:
            if all(r["status"] == SaveStatus.DISCARDED for r in missing):
                decision["status"] = SaveStatus.DISCARDED  # a newer version was first
            decision["reason"] = "; ".join(
                f"rank {r['rank']} {r['status']}" + (f": {r['error']}" if r["error"] else "")
                for r in missing
            )
            return decision
        with self._lock:
            newest = self._retained[-1] if self._retained else 0
        if version <= newest:
            decision["status"] = SaveStatus.DISCARDED
            decision["reason"] = f"not newer than global version {newest}"
            return decision
        shards = tuple(
            global_versions.ShardRef(
                r["rank"],
                global_versions.rank_dirname(r["rank"]),
                version,
                r["step"],
                r["manifest_crc32c"],
                r["nbytes"],
            )
            for r in sorted(reports, key=lambda r: r["rank"])
        )
        record = global_versions.GlobalRecord(
            version, reports[0]["step"], time.time(), self.world_size, shards
        )
        try:
            protect = self.protect() if self.protect is not None else ()
            retained = global_versions.publish(
                self.root, record, self.keep_global, self.retained, protect
            )
        except (OSError, CheckpointError) as exc:  # CheckpointError: global/ made a link
            decision["reason"] = f"could not write the global record: {exc}"
            log.warning("global version %d not published: %s", version, exc)
            return decision
        self._recent[version] = record
        while len(self._recent) > _RECENT:
            del self._recent[min(self._recent)]
        to_peers = self.peers_due is not None and self.peers_due(version, self._emergency)
        decision.update(
            status=SaveStatus.COMMITTED, retained=retained, record=record, peers=to_peers
        )
        return decision

    def _finish(self, round_: Round, decision: dict[str, Any] | None, reason: str) -> None:
        published = decision is not None and decision["status"] == SaveStatus.COMMITTED
        if published and self.writes_records:
            self._copy_record(decision["record"], decision["retained"])
        self._whole_now(decision.get("remote_whole", 0) if decision is not None else 0)
        with self._lock:
            if decision is not None and decision["status"] == SaveStatus.COMMITTED:
                self._retained = list(decision["retained"])
            if decision is not None:
                self._decided_up_to = max(self._decided_up_to, round_.version)
                if decision.get("error"):
                    self._errors.append(CheckpointError(decision["error"]))
        round_.status = SaveStatus.FAILED if decision is None else decision["status"]
        round_.reason = reason or (decision or {}).get("reason", "")
        round_.decided_at = time.perf_counter()
        if not round_.published:
            log.info("version %d is not global: %s", round_.version, round_.reason)
        round_.decided.set()
        if published:
            for listener in self.published:
                try:
                    listener(decision["record"], bool(decision.get("peers")))
                except Exception as exc:  # a listener's failure does not undo the version
                    log.error("after global version %d: %s", round_.version, exc)

    def _whole_now(self, whole: int) -> None:
        """Tell the listeners that ``whole`` is the newest version whole in the object store
        (if it is newer than the last they heard of)."""
        if whole <= self.remote_whole:
            return
        self.remote_whole = whole
        for listener in self.remote_listeners:
            try:
                listener(whole, self._recent.get(whole))
            except Exception as exc:  # the object store's bookkeeping; training goes on
                log.warning("after version %d became whole in the object store: %s", whole, exc)

    def settle_remote(self, held: list[list[int] | None]) -> None:
        """At close, once every rank's engine finished its uploads (``held``: each rank's
        shard versions in the object store, by rank): the newest version now whole there,
        which no round will decide any more, goes to the listeners (rank 0 uploads its
        record), so a job that ends leaves its newest uploaded version restorable from the
        object store alone."""
        self._whole_now(self._whole_in_remote([{"remote": versions} for versions in held]))

    def _whole_in_remote(self, reports: list[dict[str, Any]]) -> int:
        """Rank 0: the newest published version every rank's shard of which the object
        store holds (by the ranks' reports), never going back."""
        if any(r.get("remote") is None for r in reports):
            return self.remote_whole
        common = set.intersection(*(set(r["remote"]) for r in reports))
        return max([self.remote_whole, *(v for v in common if v in self._recent)])

    def _copy_record(self, record: global_versions.GlobalRecord, retained: list[int]) -> None:
        """This root's copy of a published record, and its older copies beyond ``retained``
        gone (as rank 0 prunes its own); a failure leaves this root a version behind."""
        try:
            global_versions.write_record(self.root, record)
            global_versions.write_pointer(self.root, record.version)
            for old in global_versions.record_versions(self.root):
                if old < record.version and old not in retained:
                    global_versions.delete_record(self.root, old)
        except (OSError, CheckpointError) as exc:  # CheckpointError: global/ made a link
            log.warning(
                "could not copy global record v%d to %s: %s", record.version, self.root, exc
            )
