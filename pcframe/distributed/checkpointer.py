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
import functools
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
from pcframe.distributed.meeting import Call, Doing, Meetings
from pcframe.distributed.opening import open_shards
from pcframe.distributed.protocol import CommitProtocol, Round
from pcframe.distributed.verdict import load_newest, records_to_try
from pcframe.errors import CheckpointError, SaveError
from pcframe.restore.report import DistributedRestoreReport
from pcframe.runtime.threads import one_caller_at_a_time
from pcframe.save.handle import SaveHandle
from pcframe.save.status import SaveStatus
from pcframe.state.objects import TrainingObjects
from pcframe.store.retention import KeepWhere

log = logging.getLogger("pcframe")

_KEEP_ROUNDS = 1024  # recent versions whose timings stay inspectable in `rounds`


class DistributedCheckpointer:
    """Crash-safe, concurrent checkpoints of a multi-rank job with a global commit.

    Call every method on every rank, in the same order (they are collective). Requires an
    initialised default process group of the whole job.

    Args:
        root: shared directory; rank ``r`` writes ``root/rank-<r>/``, rank 0 also
            ``root/global/`` and ``root/GLOBAL``. Restoring state that other ranks wrote
            needs every rank to see the whole root (a shared file system).
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
        config: EngineConfig | None = None,
        **overrides: Any,
    ) -> None:
        if keep_global < 2:
            raise ValueError(
                f"keep_global={keep_global}: keep at least 2 global versions, so the previous "
                "one survives while the next is being published"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise CheckpointError(
                "DistributedCheckpointer needs torch.distributed: call "
                "torch.distributed.init_process_group() on every rank first"
            )
        self.root = Path(root)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # What a restore loads into, checked before any directory is locked (the local
        # engine saves views of them; the policy is the local engine's, set below).
        self.objects = TrainingObjects.given(
            model, optimizer, scheduler, scaler, data, stateful, extra
        )
        timeout = timedelta(seconds=protocol_timeout)
        # Two private gloo groups, created in the same order on every rank: `control` for the
        # collectives of the training thread, `report` for the round thread only.
        self._control = dist.new_group(backend="gloo", timeout=timeout)
        self._report = dist.new_group(backend="gloo", timeout=timeout)
        self._stash = Stash()
        model_view = ModelView(model, self._stash) if model is not None else None
        optim_view = OptimizerView(optimizer, self._stash) if optimizer is not None else None
        opened = open_shards(
            self.root,
            functools.partial(
                Checkpointer,
                self.root / global_versions.rank_dirname(self.rank),
                model=model_view,
                optimizer=optim_view,
                scheduler=scheduler,
                scaler=scaler,
                stateful=self.objects.stateful,
                extra=extra,
                policy=policy,
                notices=notices,
                config=config,
                **overrides,
            ),
            self._control,
            self._report,
        )
        self.local, self._next = opened.local, opened.next_version
        self.objects.policy = self.local.policy
        self.protocol = CommitProtocol(
            self.root,
            self.rank,
            self.world_size,
            self._report,
            opened.retained,
            self._next - 1,
            keep_global,
        )
        # Global versions: one more reason to keep a version, in the engine's one Retention.
        self.local.retention.add(KeepWhere("global versions", self.protocol.keep))
        self._meetings = Meetings(self._control, self.world_size)
        self.splitter = StateSplitter(
            model, optimizer, self.rank, self.world_size, self._meetings.for_save
        )
        self.rounds: dict[int, Round] = {}
        self.last_restore: DistributedRestoreReport | None = None
        self._closed = False

    # --- saving ----------------------------------------------------------------------------

    @one_caller_at_a_time
    def save(self, step: int, metadata: dict[str, Any] | None = None) -> DistributedSaveHandle:
        """Start version ``n`` of the job's state at ``step`` on this rank (collective).

        Returns as soon as the local engine does (``optimizer.step()`` waits for the copy).
        The version is global when every rank's shard is durable: the handle's ``wait()``
        then returns ``SaveStatus.COMMITTED``, and raises ``SaveError`` if it did not.

        Raises:
            SaveError / CheckpointError: an earlier version failed, or the protocol stopped;
                raised after this version was started, so training may go on.
        """
        self._check_open()
        self._meetings.settle()
        start = time.perf_counter()
        round_ = Round(self._next, step, start)
        self._next += 1
        try:
            self._stash.model, self._stash.optimizer = self.splitter.split(round_.version, step)
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
        round_.call = time.perf_counter() - start
        self.rounds[round_.version] = round_
        while len(self.rounds) > _KEEP_ROUNDS:  # bounded bookkeeping in long runs
            del self.rounds[next(iter(self.rounds))]
        self.protocol.submit(round_)
        self.protocol.raise_errors()
        return DistributedSaveHandle(round_)

    @one_caller_at_a_time
    def maybe_save(
        self, step: int, metadata: dict[str, Any] | None = None
    ) -> DistributedSaveHandle | None:
        """Ask the interval policy whether to save at ``step``; if so, save on every rank.

        Collective (one small all-gather): call it at every step on every rank. Rank 0's
        periodic decision applies to all ranks, whatever their own clocks say; an emergency
        on any rank (a notice its sources saw) is a save on all, waited for until global.
        """
        self._check_open()
        deferred: SaveError | None = None
        while True:  # an earlier version's failure: raised after the meeting every rank holds
            try:
                decision = self.local.decide(step)
                break
            except SaveError as exc:
                deferred = deferred or exc
        periodic = decision.save if self.rank == 0 else False
        flags = (int(periodic or decision.emergency), int(decision.emergency))
        met = self._meetings.meet(Doing(Call.MAYBE_SAVE, self._next, step, flags=flags))
        save, emergency = met.flags
        if not save:
            if deferred is not None:
                raise deferred
            return None
        handle = self.save(step, metadata)
        if emergency:
            # The VM may soon be gone: global now. A failure is the handle's (raised next call).
            with contextlib.suppress(SaveError):
                handle.wait()
        if deferred is not None:
            raise deferred
        return handle

    def _local_save(self, step: int, version: int, metadata: dict[str, Any] | None) -> SaveHandle:
        try:
            return self.local.save(step, metadata, version=version)
        except SaveError as exc:
            if exc.version >= version:
                raise
            # An older version's failure (the round thread reports it too): start this one.
            return self.local.save(step, metadata, version=version)

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
        """
        self._check_open()
        self._meetings.settle()
        self.protocol.join()
        self._prune()
        self._meetings.meet(Doing(Call.RESTORE, self._next))
        for exc in self.protocol.take_errors():
            # An earlier save's failure, moot once rolled back; raised before the meeting it
            # left the others waiting in it, and after it in the restore's collectives.
            log.error("before the restore: %s", exc)
        start = time.perf_counter()
        records, invalid = records_to_try(self.root, self.rank, self._control)
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
            rank=self.rank,
            world_size=self.world_size,
            reshard=reshard,
            threads=threads,
            group=self._control,
        )
        if record is None:
            self.local.restarted_empty()  # e.g. this rank's earlier writers all died
            return None
        return record.step

    # --- lifecycle ---------------------------------------------------------------------------

    @one_caller_at_a_time
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
            self.local.close(clean=clean)
            try:
                if dist.is_initialized() and self.protocol.healthy:
                    # Nobody tears down a group still in use (the meeting is a barrier).
                    self._meetings.meet(Doing(Call.CLOSE, self._next))
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group(self._report)
                    dist.destroy_process_group(self._control)
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
        if dist.is_initialized():
            if self.protocol.stopped(1.0):  # else its thread is inside a collective of it
                dist.destroy_process_group(self._report)
            dist.destroy_process_group(self._control)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this DistributedCheckpointer is closed")
        self._meetings.check()

    def __enter__(self) -> DistributedCheckpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(clean=exc_type is None)
