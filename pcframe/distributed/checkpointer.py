"""``DistributedCheckpointer``: one global checkpoint from every rank's local pcframe engine.

Each rank runs an ordinary :class:`~pcframe.Checkpointer` on ``root/rank-<r>/`` (its own
writer lock, pipeline, crash-safe local commit) and gives it only the state it owns: its
shards of sharded (DTensor / FSDP2) state, and its share of the replicated (DDP) state,
every replicated tensor being written by exactly one rank. All ranks save in lockstep with
the same version number; the :mod:`~pcframe.distributed.protocol` thread makes a version
global only when every rank's shard of it is durable. Restore reads the newest global
version that verifies on every rank, with the same or a different world size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pcframe.checkpointer import Checkpointer
from pcframe.config import EngineConfig
from pcframe.distributed import global_versions
from pcframe.distributed.capture import ModelView, OptimizerView, Stash, StateSplitter
from pcframe.distributed.handle import DistributedSaveHandle
from pcframe.distributed.job_tiers import PEERS, peers_due, rank_tiers, start_job_listing
from pcframe.distributed.meeting import Call, Doing, Meetings
from pcframe.distributed.nodes import check_replicas
from pcframe.distributed.opening import open_shards
from pcframe.distributed.options import check_job_options
from pcframe.distributed.peers import peers
from pcframe.distributed.protocol import CommitProtocol, Round
from pcframe.distributed.recovery import Place, Recovery, fetched_in_memory
from pcframe.distributed.replication import PeerReplication
from pcframe.distributed.securing import NoticeSecuring, deadline_ms, monotonic
from pcframe.distributed.shadow import ShadowFill, replicated_items
from pcframe.distributed.verdict import load_newest
from pcframe.errors import CheckpointError, PolicyError, SaveError
from pcframe.format.names import version_name
from pcframe.policies.base import Notice
from pcframe.policies.placement.base import PlacementPolicy
from pcframe.restore.report import DistributedRestoreReport
from pcframe.restore.restorer import check_read_threads
from pcframe.runtime.threads import engine_call, one_caller_at_a_time
from pcframe.save.handle import SaveHandle
from pcframe.save.status import SaveStatus
from pcframe.state.objects import TrainingObjects
from pcframe.store.retention import KeepWhere
from pcframe.store.tiers import Secured, Tiers
from pcframe.store.tiers.peer import PeerStore, default_peer_directory, private_folder

log = logging.getLogger("pcframe")

_KEEP_ROUNDS = 1024  # recent versions whose timings stay inspectable in `rounds`

# Every collective method is refused on a thread inside another (a signal handler landed
# in it): a collective there hangs the job, the other ranks being in another one or none.
_COLLECTIVE = (
    "a collective there would hang the job (the other ranks are not in it): record the "
    "signal instead (notices=[SignalNoticeSource()] with policy=NoticeDriven(...): every "
    "rank saves at its next maybe_save), or set a flag and save from the loop"
)


class DistributedCheckpointer:
    """Crash-safe, concurrent checkpoints of a multi-rank job with a global commit.

    Call every method on every rank, in the same order (they are collective). Requires an
    initialised default process group of the whole job.

    Args:
        root: where rank ``r`` writes ``root/rank-<r>/``; a shared file system, or each
            node's own disk (the same path on every node, or another per node). Every root
            keeps the global records (``root/global/``, ``root/GLOBAL``), written by the
            lowest rank that uses it. A restore reads the shards other ranks wrote from the
            roots it sees, from the peer tier, or from the object store, fetching what its
            root lacks (:mod:`pcframe.distributed.recovery`).
        model, optimizer, scheduler, scaler: the usual objects; plain tensors in model and
            optimizer state are taken to be replicated (DDP), DTensors are sharded or
            replicated by their placements (FSDP2, tensor parallel).
        data, stateful, extra: per-rank state (data position, ...), saved by every rank.
        policy: interval policy for :meth:`maybe_save`. Rank 0's instance decides the
            periodic saves for the whole job; any rank's emergency decision (its notice
            sources, e.g. SIGTERM on that VM) makes every rank save. Each rank's policy
            learns from its own engine's measurements.
        notices: preemption notice sources polled by :meth:`maybe_save` on this rank.
        keep_global: global versions kept (at least 2: the current and the previous one).
        protocol_timeout: seconds a commit round waits for the slowest rank before the
            protocol gives up (a rank that died).
        tiers: replica tiers as for :class:`~pcframe.Checkpointer` (name -> path or URL);
            each rank writes its shards under ``<tier>/rank-<r>/``; rank 0 also uploads the
            records to an object store's ``<url>/global/``, where a job that lost every node
            finds them.
        placement: which tiers get each version, as for one process; a tier named
            ``"peers"`` in it is the peer tier (:mod:`pcframe.distributed.job_tiers`).
        replicas: copies of each rank's shard kept in the memory of ranks on other nodes
            (0 to 3; none when the job runs on one node).
        peer_dir: this node's folder for those copies (default: under ``/dev/shm``, named
            after ``root``, so a job restarted on this node finds them).
        peer_budget: bytes of copies one rank holds at most (default: half of the free
            memory of ``peer_dir``'s file system, split between the ranks of this node).
        node: this rank's node, when neither the launcher (``GROUP_RANK``) nor the host name
            tells (``PCFRAME_NODE`` does the same).
        config, overrides: the local engine's :class:`~pcframe.EngineConfig`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        data: Any = None,
        stateful: Mapping[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        policy: Any = None,
        notices: Any = None,
        keep_global: int = 2,
        protocol_timeout: float = 1800.0,
        tiers: Mapping[str, Any] | None = None,
        placement: PlacementPolicy | None = None,
        replicas: int = 1,
        peer_dir: str | os.PathLike[str] | None = None,
        peer_budget: int | None = None,
        node: str | None = None,
        config: EngineConfig | None = None,
        **overrides: Any,
    ) -> None:
        check_job_options(keep_global, protocol_timeout, replicas, peer_budget, peer_dir, node)
        if not dist.is_available() or not dist.is_initialized():
            raise CheckpointError(
                "DistributedCheckpointer needs torch.distributed: call "
                "torch.distributed.init_process_group() on every rank first"
            )
        self.root = Path(root)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.replicas = check_replicas(replicas)
        job_tiers = rank_tiers(tiers, self.rank)
        self.remote = job_tiers.remote
        local_tiers = None
        if job_tiers.local or placement is not None:
            local_tiers = Tiers(job_tiers.local, placement, external=(PEERS,))
        remote_newest = start_job_listing(job_tiers, local_tiers)
        # What a restore loads into, checked before any directory is locked (the local
        # engine saves views of them; the policy is the local engine's, set below).
        # (named stateful objects may also come as pairs, as dict() takes them)
        self.objects = TrainingObjects.given(
            model, optimizer, scheduler, scaler, data, stateful, extra
        )
        timeout = timedelta(seconds=protocol_timeout)
        # Three private gloo groups, created in the same order on every rank: `control` for
        # the collectives of the training thread, `report` for the round thread only, `peer`
        # for the peer tier's thread only.
        self._control = dist.new_group(backend="gloo", timeout=timeout)
        self._report = dist.new_group(backend="gloo", timeout=timeout)
        self._peer = dist.new_group(backend="gloo", timeout=timeout)
        self._stash = Stash()
        model_view = ModelView(model, self._stash) if model is not None else None
        optim_view = OptimizerView(optimizer, self._stash) if optimizer is not None else None
        self.peer_base = Path(peer_dir) if peer_dir else default_peer_directory(self.root)

        def open_local() -> Checkpointer:
            # The default folder of peer copies (under /dev/shm) is this user's own, checked
            # while the ranks open: a rank whose check fails makes every rank's open fail.
            if self.replicas > 0 and not peer_dir:
                private_folder(self.peer_base.parent)
            shard_root = self.root / global_versions.rank_dirname(self.rank)
            if os.path.islink(shard_root):  # the root may be a link, nothing in it
                raise CheckpointError(
                    f"{shard_root} is a link: a rank's folder inside a multi-rank checkpoint "
                    "is pcframe's own (restores never read through a link); put the folder "
                    "it points to in its place"
                )
            return Checkpointer(
                shard_root,
                model=model_view,
                optimizer=optim_view,
                scheduler=scheduler,
                scaler=scaler,
                stateful=self.objects.stateful,
                extra=extra,
                policy=policy,
                notices=notices,
                tiers=local_tiers,
                config=config,
                **overrides,
            )

        try:
            opened = open_shards(
                self.root,
                open_local,
                self._control,
                self._report,
                node,
                remote_newest,
                # the options that decide which collectives a rank enters (the peer rounds
                # and the restore's fetch; the object store's listing at close)
                same=(("replicas", self.replicas), ("object store", self.remote is not None)),
            )
        except BaseException:  # the open destroyed the other two groups
            dist.destroy_process_group(self._peer)
            raise
        self.local, self._next = opened.local, opened.next_version
        self.nodes, self._groups = opened.nodes, opened.groups
        self.objects.policy = self.local.policy
        self.protocol = CommitProtocol(
            self.root,
            self.rank,
            self.world_size,
            self._report,
            opened.retained,
            self._next - 1,
            keep_global,
            writes_records=self._groups[self.rank] == self.rank != 0,  # leads another root
            peers_due=peers_due(local_tiers, self.replicas) if self._has_peers() else None,
            protect=lambda: self.peers.protected() if self.peers is not None else (),
            remote_held=self._remote_held if self.remote is not None else None,
        )
        # Global versions: one more reason to keep a version, in the engine's one Retention.
        self.local.retention.add(KeepWhere("global versions", self.protocol.keep))
        self.peers: PeerReplication | None = None
        if self._has_peers():
            store = PeerStore(
                self.peer_base / f"kept-by-rank-{self.rank}",
                peer_budget,
                sharers=len(self.nodes.ranks_on(self.nodes.node_of(self.rank))),
            )
            self.peers = PeerReplication(
                self.nodes,
                self.rank,
                self.replicas,
                store,
                lambda version: self.local.directory / version_name(version),
                self._peer,
            )
        # Where this rank holds the replicated state of a rank it backs up (DDP), the copy's
        # bytes are written from its own state at each save rather than sent (shadow.py).
        self.shadows: ShadowFill | None = None
        if self.peers is not None and self.peers.sources and optimizer is not None:
            replication = self.peers
            self.shadows = ShadowFill(
                replication.store,
                replication.sources,
                optimizer,
                wanted=replication.shadows_wanted,
            )
        self._remote_wholes: list[int] = []  # the newest whole versions in the object store
        if self.remote is not None:
            self.protocol.remote_listeners.append(self._whole_in_remote)
        self._meetings = Meetings(self._control, self.world_size)
        # What a notice secures: the newest global versions (the round thread tells it of
        # each, before the peer tier's listener) and what the peer tier was given.
        self.securing = NoticeSecuring(
            self.local, self.protocol, self.world_size, self._control, self._meetings, self.peers
        )
        self.protocol.published.append(self.securing.note_global)
        if self.peers is not None:
            self.protocol.published.append(self.securing.to_peers)
        self.splitter = StateSplitter(
            model, optimizer, self.rank, self.world_size, self._meetings.for_save
        )
        self.rounds: dict[int, Round] = {}
        self.last_restore: DistributedRestoreReport | None = None
        self.last_secured: Secured | None = None  # where the last emergency version went
        self._notice_secured: Notice | None = None  # the notice the last one answered
        self._closed = False

    # --- the tiers beyond the ranks' own disks ------------------------------------------------

    def _shadow(self, version: int, placed: dict[str, Any]) -> None:
        """Start the shadow of ``version`` (after the save started: whatever goes wrong here
        costs the shadow, never the version)."""
        assert self.shadows is not None
        try:
            model = self.objects.model
            named = model.named_parameters() if model is not None else ()
            parameters = {f"model/{name}" for name, _ in named}
            items = replicated_items(placed, self.splitter.owners, self.shadows.sources, parameters)
        except Exception as exc:  # a model whose parameters cannot be listed
            log.debug("peer tier: no shadow of version %d: %s", version, exc)
            return
        self.shadows.start(version, items)

    def _has_peers(self) -> bool:
        """Whether any rank has a peer on another node to copy to (the same on every rank)."""
        return self.replicas > 0 and len(self.nodes.nodes) > 1

    def _remote_held(self) -> list[int]:
        """This rank's shard versions in the object store, as its tier last listed them."""
        remote = self.local.tiers.remote()
        return remote[1] if remote is not None else []

    def _whole_in_remote(self, version: int, record: global_versions.GlobalRecord | None) -> None:
        """A listener of the commit protocol: ``version`` is whole in the object store. Each
        rank's tier holds it and the whole version before it; rank 0 uploads its record (the
        object store's records are those of whole versions).

        Two, not one: every rank hears of ``version`` at once, and rank 0 uploads its record
        while the others may already delete what they held, so with one held, a job that
        died in between left an object store whose only record named a version no longer
        whole. The one before is let go only once a newer version is whole, which rank 0
        decides after this record's upload.
        """
        self._remote_wholes = [*self._remote_wholes[-1:], version]
        remote = self.local.tiers.remote()
        if remote is not None:
            self.local.tiers.hold(remote[0], set(self._remote_wholes))
        if self.rank == 0 and record is not None and self.remote is not None:
            try:
                self.remote.put_record(record)
            except Exception as exc:  # the object store is down: the nodes keep their copies
                log.warning("could not upload global record v%d: %s", version, exc)

    # --- saving ----------------------------------------------------------------------------

    @one_caller_at_a_time(fix=_COLLECTIVE)
    def save(self, step: int, metadata: dict[str, Any] | None = None) -> DistributedSaveHandle:
        """Start version ``n`` of the job's state at ``step`` on this rank (collective).

        Returns as soon as the local engine does (``optimizer.step()`` waits for the copy).
        The version is global when every rank's shard is durable: the handle's ``wait()``
        then returns ``SaveStatus.COMMITTED``, and raises ``SaveError`` if it did not.

        Raises:
            SaveError / CheckpointError: an earlier version failed, or the protocol stopped;
                raised after this version was started, so training may go on.
        """
        handle = self._save(step, metadata)
        self.protocol.raise_errors()
        return handle

    def _save(
        self, step: int, metadata: dict[str, Any] | None, emergency: bool = False
    ) -> DistributedSaveHandle:
        self._check_open()
        self._meetings.settle()
        start = time.perf_counter()
        round_ = Round(self._next, step, start, emergency=emergency)
        self._next += 1
        try:
            self._stash.model, self._stash.optimizer, items = self.splitter.split(
                round_.version, step
            )
            round_.meeting = self._meetings.pending  # None when waited for in split
            local_start = time.perf_counter()
            round_.handle = self._local_save(step, round_.version, metadata)
            round_.local_call = time.perf_counter() - local_start
        except BaseException as exc:
            if exc is self._meetings.broken:
                raise  # no round: the ranks cannot agree on this version
            round_.meeting = self._meetings.for_failed_save(round_.version, step)
            round_.error = exc  # the round still runs, so every rank stays in step
            self.protocol.submit(round_)
            raise
        finally:
            self._stash.model = self._stash.optimizer = None
        if self.shadows is not None:  # after the engine's copy has started
            self._shadow(round_.version, items)
        round_.call = time.perf_counter() - start
        self.rounds[round_.version] = round_
        while len(self.rounds) > _KEEP_ROUNDS:  # bounded bookkeeping in long runs
            del self.rounds[next(iter(self.rounds))]
        self.protocol.submit(round_)
        return DistributedSaveHandle(round_)

    @one_caller_at_a_time(fix=_COLLECTIVE)
    def maybe_save(
        self, step: int, metadata: dict[str, Any] | None = None
    ) -> DistributedSaveHandle | None:
        """Ask the interval policy whether to save at ``step``; if so, save on every rank.

        Collective (one small all-gather): call it at every step on every rank. Rank 0's
        periodic decision applies to all ranks, whatever their own clocks say; an emergency
        on any rank (a notice its sources saw) is a save on all, waited for until global. A
        notice the policy answers without a save secures the newest global version on every
        rank within the notice's window (:meth:`NoticeSecuring.secure_newest`; ``last_secured``).

        Raises:
            PolicyError: the interval policy, or a placement's failure the engine found late,
                failed on some rank: raised on every rank after the meeting (one line naming
                the rank and the policy); no rank saves at this step, all stay in step.
        """
        self._check_open()
        deferred = False
        failure: Exception | None = None
        while True:  # an earlier version's failure: raised after the meeting every rank holds
            try:
                decision = self.local.decide(step)
                break
            except SaveError as exc:  # the engine raises each failure once: keep every one
                self.protocol.defer(exc)
                deferred = True
            except PolicyError as exc:  # the interval policy's, or a placement's found late
                # Taken to the meeting, so every rank raises it there (meeting.Meetings.meet):
                # raised here, it left the others waiting in it for protocol_timeout.
                failure = exc
                break
            except CheckpointError:  # a collective refused (a signal handler's, in this
                raise  # call): raised at once, so this rank calls again and meets the others
            except Exception as exc:  # raised by the interval policy (or a notice source)
                failure = exc
                break
        if failure is None:
            periodic = decision.save if self.rank == 0 else False
            notice = self.local.notice
            unanswered = notice is not None and not notice.same_as(self._notice_secured)
            flags = (int(periodic or decision.emergency), int(decision.emergency), int(unanswered))
        else:  # the call fails on every rank: no save, no notice answered
            notice, unanswered, flags = None, False, (0, 0, 0)
        newest = self.securing.newest_version
        due = deadline_ms(notice)
        met = self._meetings.meet(
            Doing(Call.MAYBE_SAVE, self._next, step, flags=flags, deadline_ms=due, newest=newest),
            failure,
        )
        save, emergency, answer = met.flags
        # The earliest deadline of any rank's notice, on this rank's monotonic clock (this
        # rank's own notice may end sooner: `NoticeSecuring.secure`).
        deadline = monotonic(met.deadline)
        if unanswered:  # answered below, by the save or without one (once the ranks met)
            self._notice_secured = notice
        if not save:
            if answer:  # a notice the policy answered without a save, on some rank
                self.last_secured = self.securing.secure_newest(met.deadline, met.newest)
            if deferred:
                self.protocol.raise_errors()
            return None
        # A routine save at a notice not yet answered (a policy that reads no notices saved
        # at the notice's step) is the newest version: an emergency one, placed and secured.
        emergency = emergency or answer
        handle = self._save(step, metadata, emergency=bool(emergency))
        if emergency:
            # The VM may soon be gone: global now, within the notice's window (the shortest
            # any rank was told of). A failure is the handle's (raised next call); a version
            # not global in time stays in its round, which goes on in the background.
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                with contextlib.suppress(SaveError):
                    handle.wait(left)
            except TimeoutError:
                self.last_secured = self.securing.not_global_in_time(handle.version)
            else:
                if handle.status is SaveStatus.COMMITTED:
                    self.last_secured = self.securing.secure(handle.version, step, deadline)
        self.protocol.raise_errors()  # as save() does, after the emergency's wait
        return handle

    def _local_save(self, step: int, version: int, metadata: dict[str, Any] | None) -> SaveHandle:
        while True:
            try:
                return self.local.save(step, metadata, version=version)
            except SaveError as exc:
                if exc.version >= version:
                    raise
                # An older version's failure, raised (and so claimed) by the engine's report
                # before this one started: the round thread will not report it, so it waits
                # in the protocol's errors for save() to raise once this version is started.
                self.protocol.defer(exc)

    @engine_call(fix=_COLLECTIVE)  # it reads the last save's meeting
    def wait(self) -> None:
        """Block until every started version is decided (global or not) on this rank.

        Raises:
            SaveError / CheckpointError: the first failure not yet raised.
        """
        self._check_open()
        self._meetings.settle()
        self.protocol.join()
        self._prune()
        self.protocol.raise_errors()

    def _prune(self) -> None:
        """Apply retention once more now that the last rounds are decided.

        The local engine applies retention when it commits a version, before that version's
        round is decided, so the shards it superseded would otherwise stay until the next
        save. Safe here: every started version has finished and no save can start meanwhile.
        """
        self.local.retention.apply()

    def global_versions(self) -> list[int]:
        """Global versions this rank knows to exist (the newest ``keep_global``)."""
        return self.protocol.retained

    def stall(self, version: int) -> float | None:
        """Seconds this version blocked the training thread on this rank (after it finished).

        The distributed part of ``save()`` plus what the local engine measured (its own
        ``save()`` and any wait of ``optimizer.step()`` for the snapshot copy).
        """
        round_, record = self.rounds.get(version), self.local.records.get(version)
        if round_ is None or record is None or record.status == SaveStatus.IN_FLIGHT:
            return None
        return round_.call - round_.local_call + record.stall

    # --- restoring ---------------------------------------------------------------------------

    @one_caller_at_a_time(alone=True)  # a collective from a signal handler meanwhile hangs
    def restore(self, *, reshard: bool = True, threads: int = 4) -> int | None:
        """Load the newest global version that verifies on every rank; return its step.

        A version whose shard fails verification on any rank is skipped on all ranks (listed
        in :attr:`last_restore`, its record moved aside as ``global/.corrupt-*``) and the
        previous global version is tried. Nothing is loaded until every rank has read and
        verified its part. ``reshard=False`` refuses to lay out sharded state for a
        different world size instead of resharding it.

        Returns ``None`` when there is no global version.

        Raises:
            ReshardError: sharded state cannot be laid out for this world size.
            CheckpointError: the saved state does not fit the objects given.
            NoValidCheckpoint: global versions exist but none verifies.
            RestoreIOError, CheckpointError: a rank cannot read its part, or a rank is gone.
            UnsupportedCheckpoint: the newest version is of a newer format or codec.
            TypeError: ``threads`` is not 1..:data:`~pcframe.config.MAX_THREADS`.
        """
        # As load()'s and StorageReader's threads are (Checkpointer's are its config's), and
        # before any collective: a bad value failed deep in a rank's reader, after the other
        # ranks had met it in the restore's collectives.
        check_read_threads("restore", threads)
        self._check_open()
        if self.shadows is not None:  # a fill writes the store this restore reads
            self.shadows.wait()
        self._meetings.settle()
        self.protocol.join()
        self._prune()
        self._meetings.meet(Doing(Call.RESTORE, self._next))
        for exc in self.protocol.take_errors():
            # An earlier save's failure, moot once rolled back; raised before the meeting it
            # left the others waiting in it, and after it in the restore's collectives.
            log.error("before the restore: %s", exc)
        # Copies in this node's stores are read, sent and dropped: no store may write over
        # a copy it lets go meanwhile (PeerStore.reading).
        held = self.peers.store.reading() if self.peers is not None else contextlib.nullcontext()
        with held:
            start = time.perf_counter()
            place = Place(self.root, self.peer_base)  # copies kept here by any earlier job
            recovery = Recovery(place, self._groups, self.rank, self._control, self.remote)
            records, invalid = recovery.records()
            if self.peers is not None:  # fetch into the node's memory (recovery.Place says why)
                need = sum(s.nbytes for s in records[0].shards) if records else 0
                folder = fetched_in_memory(self.peer_base, self.root)
                recovery.fetch_in_memory(folder, self.nodes.keys[self.rank], need)
            report = self.last_restore = DistributedRestoreReport(skipped=list(invalid))

            def applied(record: global_versions.GlobalRecord, written: Any) -> None:
                self.local.resumed(record.step, written)
                report.seconds = time.perf_counter() - start

            record = load_newest(
                applied,
                self.root,
                records,
                self.objects,
                report,
                self.protocol,
                recovery,
                rank=self.rank,
                world_size=self.world_size,
                reshard=reshard,
                threads=threads,
                group=self._control,
            )
            if record is None:
                self.local.restarted_empty()  # e.g. this rank's earlier writers all died
                return None
            recovery.restored(record)
            # What a notice secures until a newer version is published (the peer tier of
            # this job may not hold it: a restarted job's peers keep nothing of it yet).
            self.securing.note_global(record)
            return record.step

    # --- lifecycle ---------------------------------------------------------------------------

    @one_caller_at_a_time(fix=_COLLECTIVE)
    def close(self, *, clean: bool = True) -> None:
        """Finish every started version, stop the threads, release the directory (collective).

        ``clean=False`` (leaving a ``with`` block on an exception): see :meth:`_leave`.
        """
        if self._closed:
            return
        if not clean or self._meetings.broken is not None:  # raised already: leave quietly
            return self._leave()
        try:
            self._meetings.settle()
        except CheckpointError:  # out of step, or a rank gone: no collective can follow
            self._leave()
            raise
        try:
            self.protocol.join()
            self._prune()
        finally:
            self._closed = True
            self.protocol.close()
            if self.shadows is not None:
                self.shadows.close()
            if self.peers is not None:  # its last rounds: every rank submitted the same ones
                self.peers.close()
            # The engine's last failures are raised after the close's meeting (raised here,
            # they left the others waiting in it for protocol_timeout): a failed version's on
            # this rank (the others know of it from its round), a placement's on every rank.
            failure: Exception | None = None
            try:
                self.local.close(clean=clean)
            except SaveError as exc:
                self.protocol.defer(exc)
            except Exception as exc:
                failure = exc
            try:
                if dist.is_initialized() and self.protocol.healthy:
                    # Nobody tears down a group still in use (the meeting is a barrier).
                    self._meetings.meet(Doing(Call.CLOSE, self._next), failure)
                    if self.remote is not None:  # every rank is here: the uploads are over
                        held: list[Any] = [None] * self.world_size
                        with peers("closing: the object store's newest whole version"):
                            dist.all_gather_object(held, self._remote_held(), group=self._control)
                        self.protocol.settle_remote(held)
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group(self._peer)
                    dist.destroy_process_group(self._report)
                    dist.destroy_process_group(self._control)
                self._let_go_of_groups(rounds=True, peers=True)
            if failure is not None:  # no meeting to tell the others: raised here alone
                raise failure
        self.protocol.raise_errors()

    def _leave(self) -> None:
        """Close after an exception here, without a collective (peers may be anywhere: waiting
        would hang a job that, without pcframe, ends). Rounds get 5 s to be decided, later ones
        are not published; the local engine finishes its versions; the groups are destroyed so
        a peer waiting on this rank fails at once; errors are logged, not raised over the
        user's exception."""
        self._closed = True
        self.protocol.settle(5.0)
        self.protocol.abandon("this rank closed after an exception")
        try:
            self.local.close(clean=False)
        except CheckpointError as exc:
            log.error("closing after an exception: %s", exc)
        for exc in self.protocol.take_errors():
            log.error("closing after an exception: %s", exc)
        if self.shadows is not None:  # a fill is local writes: it ends
            self.shadows.close()
        peers_stopped = self.peers is None or self.peers.stop(1.0)
        rounds_stopped = self.protocol.stopped(1.0)  # else its thread is in a collective
        if dist.is_initialized():
            if rounds_stopped:
                dist.destroy_process_group(self._report)
            if peers_stopped:
                dist.destroy_process_group(self._peer)
            dist.destroy_process_group(self._control)
        self._let_go_of_groups(rounds=rounds_stopped, peers=peers_stopped)

    def _let_go_of_groups(self, *, rounds: bool, peers: bool) -> None:
        """Drop this checkpointer's references to its groups and their pending work, once
        destroyed (those of a thread still running stay with it). The checkpointer is in
        reference cycles (its threads' targets, callbacks), so it may live until the
        interpreter exits, and a gloo group or work freed that late, when torch's C++ state
        is being torn down, aborted the process ("terminate called without an active
        exception": 1 job in 5, after a clean close)."""
        self._meetings.let_go()
        self._control = None
        self.securing.let_go()
        if rounds:
            self.protocol.let_go()
            self._report = None
        if peers:
            if self.peers is not None:
                self.peers.let_go()
            self._peer = None

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this DistributedCheckpointer is closed")
        self._meetings.check()

    def __enter__(self) -> DistributedCheckpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(clean=exc_type is None)
