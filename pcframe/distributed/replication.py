"""The peer tier's transfers: each global version's shards copied to ranks on other nodes.

Once a version is global and placed in the peer tier (the commit protocol's decision, the
same on every rank), every rank sends its shard to its replica ranks
(:func:`~pcframe.distributed.nodes.replica_ranks`) and receives the shards of the ranks it
backs up into its :class:`~pcframe.store.tiers.peer.PeerStore`. One round per version, in
version order, on a thread of its own with a gloo group nothing else uses (as the commit
protocol's rounds, for the same reasons: training never waits for it, and its collectives
never interleave with the job's):

1. ``all_gather`` of the newest version each rank has queued: the round copies the oldest
   of those (every rank has it), and versions older than it that are still queued are
   skipped (a newer copy supersedes them: a slow peer costs versions, never memory);
2. ``all_gather`` of what each rank offers: the version and, for a delta version, the base
   versions it reads, with their sizes (every file) and manifest checksums (a shard it
   cannot read offers nothing);
3. ``all_gather`` of what each rank takes: per rank it backs up, the versions it lacks and
   has room for, made for all of them together (:meth:`PeerStore.admit`); a copy that does
   not fit is declined;
4. the transfers, in one order every rank follows (sender ascending, then receiver, bases
   first), each a :func:`~pcframe.distributed.shard_stream.send_version` /
   :func:`~pcframe.distributed.shard_stream.receive_version` pair, every piece verified,
   each copy no larger than offered (the room made for it); a delta whose base was refused
   in this round is received (the stream stays in step) but not kept;
5. ``all_gather`` of the copies each rank now holds, so a sender knows its shard is safe
   (:meth:`PeerReplication.copied`: what a preemption notice waits for). A version every
   shard of which reached its peers is *secured*, and each store pins it
   (:meth:`PeerStore.pin`): its copies stay until a newer one is secured.

A peer that dies or stops answering breaks a transfer after the group's timeout, and so
does anything else that goes wrong in a round (a store that cannot be listed): from then on
this process replicates nothing (logged once; the status says so; waiters are released)
and training goes on.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pcframe.distributed.global_versions import GlobalRecord
from pcframe.distributed.nodes import NodeMap, backed_up_by, replica_ranks
from pcframe.distributed.shard_stream import Streamed, receive_version, send_version
from pcframe.errors import CheckpointError, CorruptCheckpoint, ManifestError
from pcframe.format.manifest import delta_base, manifest_crc
from pcframe.format.names import MANIFEST_NAME
from pcframe.runtime.threads import single_threaded_torch
from pcframe.store.tiers.peer import PeerStore, copy_bytes

log = logging.getLogger("pcframe")

# A job runs for weeks with a save every few seconds: the status keeps the newest of what it
# lists, so a peer that declines or refuses every round cannot grow a rank's memory for ever.
STATUS_KEPT = 256


@dataclass
class PeerStatus:
    """What the peer tier has done on this rank (read from any thread)."""

    # versions whose round completed, the newest STATUS_KEPT (`copied_count`: all of them)
    copied: deque[int] = field(default_factory=lambda: deque(maxlen=STATUS_KEPT))
    copied_count: int = 0
    skipped: int = 0  # queued versions superseded by a newer one before their round
    sent_bytes: int = 0
    received_bytes: int = 0
    # of received_bytes: found right in a shadow (written from this rank's own state), not sent
    shadow_bytes: int = 0
    declined: int = 0  # copies this rank had no room for
    # copies refused, one line each, the newest STATUS_KEPT (`failures`: all of them)
    failed: deque[str] = field(default_factory=lambda: deque(maxlen=STATUS_KEPT))
    failures: int = 0
    seconds: float = 0.0  # in rounds, all told
    broken: str = ""  # why replication stopped for this process ("" while it runs)


class PeerReplication:
    """The peer rounds of one rank (see the module docstring).

    Args:
        nodes: which ranks share a node.
        rank: this rank.
        replicas: copies of each shard on other nodes.
        store: this rank's copies of the ranks it backs up.
        shard_dir: the folder of one of this rank's own versions.
        group: a gloo group of every rank, used by this thread alone.
    """

    def __init__(
        self,
        nodes: NodeMap,
        rank: int,
        replicas: int,
        store: PeerStore,
        shard_dir: Callable[[int], Path],
        group: Any,
    ) -> None:
        self.nodes, self.rank, self.replicas = nodes, rank, replicas
        self.store, self.shard_dir, self._group = store, shard_dir, group
        self.targets = replica_ranks(nodes, rank, replicas)
        self.sources = backed_up_by(nodes, rank, replicas)
        self.status = PeerStatus()
        # Ranks whose shadow got a chunk wrong: their state is not this rank's (not DDP),
        # so their copies stream whole from then on (shadow.py).
        self.unshadowed: set[int] = set()
        # The newest version every shard of which reached all its peers: what a restore
        # can have after losing any one node; and the versions queued or in a round here.
        # The records' retention keeps both (:meth:`protected`).
        self.secured = 0
        self._undecided: set[int] = set()  # submitted, round not ended yet
        self._records: queue.Queue[GlobalRecord | None] = queue.Queue()
        self._done = threading.Condition()
        # The newest version whose round ended here (copied or not): rounds end in version
        # order, and a round ends every older version still queued, so every version
        # submitted up to it has ended (a watermark: a set would grow with every save).
        self._decided_through = 0
        self._thread = threading.Thread(target=self._loop, name="pcframe-peers", daemon=True)
        self._thread.start()

    # --- used by the commit protocol's thread and the training thread --------------------

    def submit(self, record: GlobalRecord) -> None:
        """Copy ``record``'s version (every rank submits the same versions in order)."""
        with self._done:
            self._undecided.add(record.version)
        self._records.put(record)

    def wait(self, version: int, timeout: float | None = None) -> bool:
        """Whether ``version``'s round ended here (copied, skipped or failed) in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done:
            while version > self._decided_through and not self.status.broken:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._done.wait(left)
            return version <= self._decided_through

    def shadows_wanted(self, src: int) -> bool:
        """Whether ``src``'s copies are still worth a shadow (asked by the training thread)."""
        return not self.status.broken and src not in self.unshadowed

    def protected(self) -> frozenset[int]:
        """The global versions whose records (and so shards) must stay: the newest secured
        one, and those this rank may still copy (a lost node's shards exist only there)."""
        with self._done:
            return frozenset(self._undecided | {self.secured})

    def copied(self, version: int) -> bool:
        """Whether every copy of this rank's shard of ``version`` reached its peers (asked of
        the newest versions: the status keeps the last STATUS_KEPT copied)."""
        return version in self.status.copied

    def close(self) -> None:
        """Finish the rounds submitted (every rank submitted the same), then stop."""
        self._records.put(None)
        self._thread.join()

    def stop(self, timeout: float) -> bool:
        """Stop without finishing (this rank leaves on an error): whether the thread ended
        within ``timeout`` s (else it is inside a collective of the peer group)."""
        self.status.broken = self.status.broken or "this rank closed after an exception"
        self._records.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def let_go(self) -> None:
        """Forget the group (destroyed; the thread has ended)."""
        assert not self._thread.is_alive()
        self._group = None

    # --- the round thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        single_threaded_torch()
        pending: list[GlobalRecord] = []
        closing = False
        while not closing or pending:
            if not pending:
                item = self._records.get()
                if item is None:
                    return
                pending.append(item)
            while True:  # take what else is queued: a round copies the newest all have
                try:
                    more = self._records.get_nowait()
                except queue.Empty:
                    break
                if more is None:  # close(): the rounds every rank was given still run
                    closing = True
                    break
                pending.append(more)
            if self.status.broken:
                self._finish([r.version for r in pending], copied=False)
                pending.clear()
                continue
            pending = self._round(pending)

    def _round(self, pending: list[GlobalRecord]) -> list[GlobalRecord]:
        """One round; returns the records still queued for a later one."""
        start = time.perf_counter()
        try:
            # Every rank's queued versions: the round copies the newest every rank was
            # told of, and every rank sees whether one lacks it, so all stop together
            # rather than the others waiting in the round's collectives until the timeout.
            queued: list[Any] = [None] * self.nodes.world_size
            dist.all_gather_object(queued, [r.version for r in pending], group=self._group)
            version = min(versions[-1] for versions in queued)
            lacking = [rank for rank, versions in enumerate(queued) if version not in versions]
            if lacking:  # a rank was not told of a version the others were
                raise CheckpointError(
                    f"peer round for version {version}: not published on rank(s) {lacking}"
                )
            record = next(r for r in pending if r.version == version)
            older = [r.version for r in pending if r.version < version]
            self.status.skipped += len(older)
            self._finish(older, copied=False)
            with self.store.spare_lock:  # not while a shadow is written into the spare
                self._copy(record)
        except Exception as exc:  # a peer died or stopped answering, or this rank's store
            # failed: either way the rounds cannot go on in step with the other ranks.
            lines = str(exc).splitlines()
            with self._done:  # at once: a waiter woken by `broken` finds its round ended
                self.status.broken = f"{type(exc).__name__}: {(lines[0] if lines else '')[:300]}"
                self._finish([r.version for r in pending], copied=False)
            log.error(
                "peer tier: replication stopped on rank %d (%s); versions stay on local disk "
                "and in the other tiers; restart the job to resume it",
                self.rank,
                self.status.broken,
            )
            return []
        self.status.seconds += time.perf_counter() - start
        return [r for r in pending if r.version > record.version]

    def _copy(self, record: GlobalRecord) -> None:
        """Steps 2-4 of a round for ``record`` (collective on the peer group)."""
        offers: list[Any] = [None] * self.nodes.world_size
        dist.all_gather_object(offers, self._offer(record.version), group=self._group)
        wants: list[Any] = [None] * self.nodes.world_size
        dist.all_gather_object(wants, self._want(offers), group=self._group)
        pinned = {s.rank: s.manifest_crc32c for s in record.shards}
        offered = {  # (src, version): (bytes, manifest crc) as the sender offered it
            (src, v): (n, crc) for src, chain in enumerate(offers) for v, n, crc in chain or ()
        }
        kept: list[tuple[int, int]] = []  # (src, version) this rank now holds
        refused: set[int] = set()  # ranks a copy of which failed here this round
        for src, dst, version in _transfers(wants):
            if src == self.rank:
                self.status.sent_bytes += send_version(self.shard_dir(version), dst, self._group)
            elif dst == self.rank:
                size, crc = offered[(src, version)]
                pin = pinned.get(src) if version == record.version else crc or None
                # A later version of a chain whose base failed reads nothing: not kept.
                if self._receive(src, version, pin, size, keep=src not in refused):
                    kept.append((src, version))
                else:
                    refused.add(src)
        for src, wanted in (wants[self.rank] or {}).items():  # held already: nothing was sent
            if not wanted:
                kept.append((src, record.version))
        holders: list[Any] = [None] * self.nodes.world_size
        dist.all_gather_object(holders, kept, group=self._group)
        mine = (self.rank, record.version)
        safe = all(mine in (holders[dst] or []) for dst in self.targets)
        everywhere = all(  # every rank's shard on every one of its peers: the same on all
            (src, record.version) in (holders[dst] or [])
            for src in range(self.nodes.world_size)
            for dst in replica_ranks(self.nodes, src, self.replicas)
        )
        if everywhere and record.version > self.secured:
            self.secured = record.version
            self.store.pin(record.version)  # its copies stay until a newer one is secured
        self._finish([record.version], copied=safe)

    def _offer(self, version: int) -> list[tuple[int, int, str]] | None:
        """``[(version, bytes, manifest crc)]`` this rank can send for ``version``, bases
        first (bytes: every file of it, what a copy takes of the peer's budget)."""
        chain, current = [], version
        try:
            while True:
                directory = self.shard_dir(current)
                crc = manifest_crc(directory / MANIFEST_NAME)
                chain.append((current, copy_bytes(directory), crc))
                current = delta_base(directory)
                if not current:
                    return chain[::-1]
        except (OSError, ManifestError) as exc:
            log.warning("peer tier: rank %d cannot offer version %d: %s", self.rank, version, exc)
            return None

    def _want(self, offers: list[Any]) -> dict[int, list[int]]:
        """Per backed-up rank, the offered versions this rank lacks and has room for."""
        chains = {src: offers[src] for src in self.sources if offers[src] is not None}
        wanted: dict[int, list[int]] = {}
        try:
            admitted = self.store.admit(chains)
        except OSError as exc:  # this rank's store is broken: it takes nothing this round,
            # in step with the others (raising here would leave them in the collective).
            self.status.declined += len(chains)
            self._failed(f"this rank's store: {exc}")
            log.warning("peer tier: rank %d cannot use its store: %s", self.rank, exc)
            return {}
        for src, versions in admitted.items():
            if versions is not None:
                wanted[src] = versions
                continue
            self.status.declined += 1
            log.warning(
                "peer tier: rank %d has no room for rank %d's version %d (%d bytes with its "
                "bases, budget %d): declined",
                self.rank,
                src,
                chains[src][-1][0],
                sum(n for _, n, _ in chains[src]),
                self.store.budget,
            )
        return wanted

    def _receive(self, src: int, version: int, pin: str | None, size: int, keep: bool) -> bool:
        """Receive one copy (no larger than ``size``, the room made for it); kept, and True,
        only if it is verified and ``keep`` (else received and dropped: the stream stays in
        step with the sender)."""
        try:
            staging = self.store.staging(src, version)
        except OSError as exc:  # refused on its manifest (room for nothing: nothing is
            # written), in step with the sender, which streams it whatever happens here
            with contextlib.suppress(CorruptCheckpoint, ManifestError):
                receive_version(src, self.store.directory, self._group, limit=0)
            self._failed(f"rank {src} v{version}: {exc}")
            log.warning("peer tier: copy of rank %d's version %d refused: %s", src, version, exc)
            return False
        try:
            tally = Streamed()
            shadow = None if src in self.unshadowed else self.store.shadow_of(src, version)
            manifest = receive_version(
                src, staging, self._group, pin, self.store.spare, size, shadow, tally
            )
            if tally.missed:
                self.unshadowed.add(src)
                log.info(
                    "peer tier: rank %d's shadow of rank %d's version %d got %d chunk(s) "
                    "wrong (their replicated state differs): its copies stream whole from now",
                    self.rank,
                    src,
                    version,
                    tally.missed,
                )
            if keep:
                self.store.commit(src, version, staging)
        except (CorruptCheckpoint, ManifestError, OSError) as exc:
            self.store.discard(staging)
            self._failed(f"rank {src} v{version}: {exc}")
            log.warning("peer tier: copy of rank %d's version %d refused: %s", src, version, exc)
            return False
        if not keep:
            self.store.discard(staging)
            self._failed(f"rank {src} v{version}: its base was refused")
            log.warning(
                "peer tier: copy of rank %d's version %d dropped: a version it reads was "
                "refused in the same round",
                src,
                version,
            )
            return False
        self.status.received_bytes += manifest.stored_bytes
        self.status.shadow_bytes += tally.prefilled
        return True

    def _failed(self, line: str) -> None:
        self.status.failed.append(line)
        self.status.failures += 1

    def _finish(self, versions: list[int], copied: bool) -> None:
        with self._done:
            self._decided_through = max([self._decided_through, *versions])
            self._undecided.difference_update(versions)
            if copied:
                self.status.copied.extend(versions)
                self.status.copied_count += len(versions)
            self._done.notify_all()


def _transfers(wants: list[Any]) -> list[tuple[int, int, int]]:
    """``(src, dst, version)`` of every copy, in the one order every rank follows."""
    return sorted(
        (src, dst, version)
        for dst, wanted in enumerate(wants)
        for src, versions in (wanted or {}).items()
        for version in versions
    )
