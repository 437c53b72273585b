"""A multi-rank restore when the shards are not all where each rank reads them.

After a VM is lost, its local disk and memory are gone: its ranks come back on an empty
node, and the other nodes never had its shards on their own disks. What can still be had:

* a shard in a root a rank reads (its own folder, or every rank's on a shared file system);
* a copy in a node's memory kept by the peer tier (:mod:`pcframe.distributed.replication`);
* a shard a restore fetched before (``<root>/.fetched/rank-<r>/vN``);
* a shard in the object store (:mod:`pcframe.distributed.remote_shards`).

:class:`Recovery` makes every shard of a global version readable on every rank before the
usual restore reads it (:func:`~pcframe.distributed.verdict.load_newest`), in rounds, each
collective on the restore's group:

1. ``all_gather`` of what each rank can read (:class:`Holdings`; a root's leader, the lowest
   rank that shares it, also sends the records it holds, rank 0 the object store's listing);
2. the same plan on every rank (:func:`plan_round`): for each root that lacks a shard, one
   of its ranks receives it from a rank that can read it, spread over the senders by
   bytes; a shard no rank can read is downloaded from the object store by one rank of the
   first root that needs it, and sent from there to the others the round after: each byte
   of the object store is read once across the job;
3. the transfers (every piece verified against the record's manifest checksum and the
   manifest's chunk checksums); a copy that fails is not used again, and the next round
   takes another holder. A send and its receive block each other, so every rank runs its
   own transfers in one order, made of steps in which no rank takes part twice
   (:func:`in_steps`): transfers between different pairs of ranks run at the same time.

The rounds end when every root can read every shard (delta versions add their bases as they
are found), or when a shard is nowhere: the version is then unavailable and the restore
takes the previous one (said at WARNING, never quarantined).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import socket
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pcframe.distributed import global_versions
from pcframe.distributed.global_versions import GlobalRecord, rank_dirname
from pcframe.distributed.nodes import spread
from pcframe.distributed.peers import peers
from pcframe.distributed.remote_shards import RemoteShards
from pcframe.distributed.shard_stream import receive_version, send_version
from pcframe.errors import (
    CheckpointError,
    ManifestError,
    RestoreIOError,
    TierError,
    UnsupportedCheckpoint,
)
from pcframe.format.files import is_real_directory
from pcframe.format.manifest import delta_base
from pcframe.format.names import MANIFEST_NAME, RANK_DIR, version_name, version_number
from pcframe.format.stripes import stored_data_bytes
from pcframe.restore.sources import stop_at_unsupported
from pcframe.store.directory import set_aside

log = logging.getLogger("pcframe")

FETCHED = ".fetched"  # in a root: shards a restore fetched from a peer or the object store
_NOWHERE = Path(os.devnull) / "pcframe"  # below a device: no folder can ever be made there
FETCHED_IN_MEMORY = "fetched"  # the same in a node's peer folder (a job with a peer tier)


def fetched_in_memory(peer_base: Path, root: Path) -> Path:
    """Where a job with a peer tier fetches shards in its node's memory: one folder per root
    (ranks with other roots may share ``peer_base``)."""
    key = hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:12]
    return peer_base / FETCHED_IN_MEMORY / key


MAX_ROUNDS = 8


class Kind(Enum):
    """Where a rank found a shard it reads."""

    LOCAL = "local disk"
    PEER = "peer memory"
    FETCHED = "fetched"
    REMOTE = "object store"


@dataclass(frozen=True)
class Place:
    """Where one rank reads shards without the network: its root, the copies kept in its
    node's memory by the peer tier (``peer_base``: the folder of every rank's peer store on
    this node), and what a restore fetched (``fetch_dir``: ``<root>/.fetched`` unless given).

    A job with a peer tier fetches into its node's memory (:func:`fetched_in_memory`,
    ``<peer_base>/fetched/<root key>``) when the newest version fits there: writing
    a fetched shard there costs a memory copy, where the root's disk takes it at the disk's
    write speed (a restore's fetch waited on that more than on the network). Copies fetched
    into the root by an earlier restore stay readable either way.
    """

    root: Path
    peer_base: Path | None = None
    fetch_dir: Path | None = None

    @property
    def fetch_into(self) -> Path:
        return self.fetch_dir if self.fetch_dir is not None else self.root / FETCHED

    def folders(self) -> list[tuple[Kind, Path]]:
        """Every folder of shards here. Only the root and the peer folder may be links (the
        user names them); a link anywhere below is passed over, never followed."""
        found = [(Kind.LOCAL, self.root)]
        for fetch_dir in [None] + ([self.fetch_dir] if self.fetch_dir is not None else []):
            top, names = fetch_chain(self.root, self.peer_base, fetch_dir)
            if _real_below(top, names):
                found.append((Kind.FETCHED, top.joinpath(*names)))
        if self.peer_base is not None and self.peer_base.is_dir():
            found += [
                (Kind.PEER, d)
                for d in sorted(self.peer_base.iterdir())
                if d.name != FETCHED_IN_MEMORY and is_real_directory(d)
            ]
        return found

    def find(self, src: int, version: int) -> tuple[Kind, Path] | None:
        """Where ``src``'s shard of ``version`` is complete here, if anywhere."""
        for kind, folder in self.folders():
            if _real_below(folder, (rank_dirname(src), version_name(version))):
                path = folder / rank_dirname(src) / version_name(version)
                if (path / MANIFEST_NAME).is_file():
                    return kind, path
        return None

    def readable(self) -> dict[int, dict[int, int]]:
        """``{src: {version: base}}`` of every complete shard here (base 0: a full one)."""
        found: dict[int, dict[int, int]] = defaultdict(dict)
        for _, folder in self.folders():
            for src, version, path in _shards(folder):
                if version not in found[src]:
                    found[src][version] = _base_of(path)
        return {src: dict(v) for src, v in found.items()}

    def fetch_path(self, src: int, version: int) -> Path:
        return self.fetch_into / rank_dirname(src) / version_name(version)

    def make_fetch_folder(self, src: int) -> Path:
        """The folder ``src``'s fetched shards go to, made (each level a directory of its
        own: a link or file planted in its place is removed, never written through)."""
        top, names = fetch_chain(self.root, self.peer_base, self.fetch_dir)
        return _own_folder(top, (*names, rank_dirname(src)))

    def keep_fetched(self, record: GlobalRecord) -> None:
        """Remove every fetched copy but ``record``'s shards and the bases they read (the
        fetched folders hold one restored version, not one per restart)."""
        keep: set[tuple[int, int]] = set()
        for shard in record.shards:
            src, version = shard.rank, shard.version
            while version and (src, version) not in keep:
                keep.add((src, version))
                found = self.find(src, version)
                version = _base_of(found[1]) if found else 0
        for kind, folder in self.folders():
            if kind is not Kind.FETCHED:
                continue
            for src, version, path in _entries(folder):
                if (src, version) not in keep:  # leftovers (.tmp, .download, links) too
                    _remove(path)


def fetch_groups(
    root_groups: Sequence[int], node: str | None, fetch_dir: Path, rank: int, group: Any
) -> list[int]:
    """Per rank, the lowest rank that reads the same fetched folder (collective): ranks that
    share a root and the folder's path and, for a folder in a node's memory (``node``: the
    node's key), the node and host. What one of them fetches every other reads; a restore
    fetches each shard once per such group."""
    where = (node, socket.gethostname()) if node is not None else ()
    mine = (root_groups[rank], *where, str(fetch_dir.resolve()))
    gathered: list[Any] = [None] * len(root_groups)
    with peers("restore: agreeing where fetched shards go"):
        dist.all_gather_object(gathered, mine, group=group)
    return [next(r for r, other in enumerate(gathered) if other == row) for row in gathered]


@dataclass
class Holdings:
    """What one rank tells the others at the start of a round."""

    rank: int
    readable: dict[int, dict[int, int]]  # src -> {version: base}
    records: dict[int, bytes] = field(default_factory=dict)  # a root leader's record files
    unsupported: tuple[int, str] | None = None  # (version, why): a newer-format newest record
    remote: dict[int, list[int]] | None = None  # rank 0: src -> versions in the object store
    bad: list[tuple[int, int, int]] = field(default_factory=list)  # (holder, src, version)
    error: str = ""  # why this rank's records could not be listed: raised on every rank
    remote_error: str = ""  # rank 0: why the object store could not be read


@dataclass(frozen=True)
class Transfer:
    sender: int
    receiver: int
    src: int  # the rank whose shard it is
    version: int


@dataclass(frozen=True)
class Download:
    reader: int
    src: int
    version: int


@dataclass
class FetchReport:
    """What making a version readable cost this rank."""

    peer_bytes: int = 0  # received from other ranks
    remote_bytes: int = 0  # downloaded from the object store
    sent_bytes: int = 0
    seconds: float = 0.0
    rounds: int = 0


class Recovery:
    """Makes every shard of a version readable on this rank (see the module docstring).

    Args:
        place: where this rank reads shards.
        groups: per rank, the lowest rank that shares its root (one id per root).
        rank, group: this rank and the restore's process group (every rank).
        remote: the object store's copies, if the job has one.
    """

    def __init__(
        self,
        place: Place,
        groups: Sequence[int],
        rank: int,
        group: Any,
        remote: RemoteShards | None = None,
    ) -> None:
        self.place, self.groups, self.rank, self._group = place, list(groups), rank, group
        # Per rank, the lowest rank that reads the same fetched folder: the root's, unless
        # fetch_in_memory says otherwise.
        self.fetchers = self.groups
        self.remote = remote
        self.bad: list[tuple[int, int, int]] = []
        self.report = FetchReport()
        self._remote_listing: dict[int, list[int]] | None = None
        self._remote_error = ""  # why the object store could not be read in this restore
        self._holdings: list[Holdings] = []  # what every rank held at the last gather
        # Versions a shard of which was set aside in its root to be fetched again (known on
        # every rank): one that then cannot be had is damaged, not merely out of reach.
        self.refetched: set[int] = set()

    @property
    def leader(self) -> bool:
        return self.groups[self.rank] == self.rank

    # --- records ---------------------------------------------------------------------------

    def records(self) -> tuple[list[GlobalRecord], list[tuple[int, str]]]:
        """Every valid record any root (or the object store) holds, newest first, and the
        invalid ones (collective).

        Raises:
            UnsupportedCheckpoint: on every rank, when the newest record anywhere is of a
                newer format (restoring an older one would drop its work).
        """
        holdings = self._gather(records=True)
        by_version: dict[int, GlobalRecord] = {}
        invalid: dict[int, str] = {}
        unsupported = [h.unsupported for h in holdings if h.unsupported is not None]
        for h in holdings:
            for version, raw in sorted(h.records.items()):
                where = f"rank {h.rank}'s copy of {version_name(version)}.json"
                try:
                    record = global_versions.record_from_bytes(raw, where)
                except UnsupportedCheckpoint as exc:
                    unsupported.append((version, str(exc)))
                    continue
                except ManifestError as exc:
                    invalid.setdefault(version, str(exc))
                    continue
                by_version.setdefault(record.version, record)
                invalid.pop(record.version, None)
        newest = max(by_version, default=0)
        newer = [(v, why) for v, why in unsupported if v > newest]
        if newer:
            back = "move that record out of global/ to restore an older version"
            raise UnsupportedCheckpoint(
                stop_at_unsupported("the newest global record", max(newer)[1], back)
            )
        good = [by_version[v] for v in sorted(by_version, reverse=True)]
        unread = next((h.remote_error for h in holdings if h.remote_error), "")
        if unread and not good:  # "no checkpoint" would start the job again from step 0
            raise RestoreIOError(
                "restore: cannot tell whether a checkpoint exists: no node holds a global "
                f"record and the object store cannot be read ({unread}); fix the storage or "
                "its settings and restart the job (nothing was read or changed)"
            )
        if unread and self.rank == 0:
            log.warning(
                "restore: the object store cannot be read (%s); restoring from what the nodes hold",
                unread,
            )
        return good, sorted(invalid.items(), reverse=True)

    # --- making a version readable ----------------------------------------------------------

    def gather_version(self, record: GlobalRecord) -> str:
        """Fetch what this rank's root lacks of ``record`` (collective); ``""`` once every
        rank can read every shard, else why the version cannot be had."""
        start = time.perf_counter()
        try:
            for round_ in range(MAX_ROUNDS):
                holdings = self._gather(records=False)
                transfers, downloads, missing = plan_round(record, holdings, self.fetchers)
                if missing:
                    return missing
                if not transfers and not downloads:
                    return ""
                self.report.rounds = round_ + 1
                self._run(record, transfers, downloads)
            return f"version {record.version}: shards still missing after {MAX_ROUNDS} rounds"
        finally:
            self.report.seconds += time.perf_counter() - start

    def locate(self, src: int, version: int) -> Path:
        """Where this rank reads ``src``'s shard of ``version`` (after :meth:`gather_version`);
        its place in the root when it is nowhere (the read then names that path)."""
        found = self.place.find(src, version)
        if found is None:
            return self.place.root / rank_dirname(src) / version_name(version)
        return found[1]

    def damaged_copies(self, record: GlobalRecord, message: str) -> list[Path]:
        """The copies (a peer's, or fetched) of ``record``'s shards that ``message`` (a
        read's error) names; none when the damage is in a shard's own folder (the
        version's), or when the copies cannot be listed (the caller must still reach the
        verdict exchange)."""
        return [path for kind, _, path in self._named(record, message) if kind is not Kind.LOCAL]

    def local_damage(self, record: GlobalRecord, message: str) -> tuple[int, int] | None:
        """``(src, version)`` of the shard in this rank's root that ``message`` (a read's
        error) names, if any."""
        local = [shard for kind, shard, _ in self._named(record, message) if kind is Kind.LOCAL]
        return (local[0].rank, local[0].version) if local else None

    def _named(self, record: GlobalRecord, message: str) -> list[tuple[Kind, Any, Path]]:
        """``(kind, shard, folder)`` of each of ``record``'s shards readable here whose folder
        ``message`` names; none when the folders cannot be listed."""
        named = []
        try:
            for shard in record.shards:
                found = self.place.find(shard.rank, shard.version)
                if found is not None and str(found[1]) in message:
                    named.append((found[0], shard, found[1]))
        except OSError:
            return []
        return named

    def held_elsewhere(self, src: int, version: int, reader: int) -> bool:
        """Whether, at the last gather, a rank outside ``reader``'s root could read ``src``'s
        shard of ``version`` (a peer's copy, one fetched before), or the object store
        holds it: then a damaged copy in that root can be fetched again, not the version
        lost."""
        bad = {entry for h in self._holdings for entry in h.bad}  # copies that failed already
        for h in self._holdings:
            remote = h.remote is not None and version in h.remote.get(src, ())
            if remote and (-1, src, version) not in bad:
                return True
            held = version in h.readable.get(src, {}) and (h.rank, src, version) not in bad
            if held and self.groups[h.rank] != self.groups[reader]:
                return True
        return False

    def set_aside_local(self, src: int, version: int, reason: str) -> None:
        """Move a damaged shard out of this rank's root (its files kept, as a one-rank
        restore sets a damaged version aside), so that the next gather fetches it."""
        set_aside(self.place.root / rank_dirname(src), version, reason)
        log.warning(
            "restore: set aside rank %d's damaged shard of version %d in %s; fetching it from "
            "another holder",
            src,
            version,
            self.place.root,
        )

    def drop_copies(self, copies: list[Path]) -> None:
        """Forget damaged copies (:meth:`damaged_copies`, once every rank has read): the
        next gather brings them from another holder."""
        for folder in copies:
            shutil.rmtree(folder, ignore_errors=True)
            log.warning("restore: dropped the damaged copy %s", folder)

    def fetch_in_memory(self, folder: Path, node: str, need: int) -> None:
        """Fetch into ``folder`` in this node's memory when its file system has ``need``
        bytes free (the newest version's shards), else into the root (collective)."""
        try:
            _own_folder(*fetch_chain(self.place.root, self.place.peer_base, folder))
            roomy = shutil.disk_usage(folder).free >= need
        except OSError:
            roomy = False
        if not roomy:
            log.info("restore: not enough room in %s; fetching into %s", folder, self.place.root)
        self.place = Place(self.place.root, self.place.peer_base, folder if roomy else None)
        in_memory = node if roomy else None
        self.fetchers = fetch_groups(
            self.groups, in_memory, self.place.fetch_into, self.rank, self._group
        )

    def restored(self, record: GlobalRecord) -> None:
        """``record`` is applied on every rank: the lowest rank of each fetched folder keeps
        only its shards there (every rank has read what it needed by then), so a restart on
        this node before the next version reads them again without fetching them."""
        if self.fetchers[self.rank] != self.rank:
            return
        try:
            self.place.keep_fetched(record)
        except OSError as exc:  # a cache left as it is: the restore itself succeeded
            log.warning("restore: could not clear older fetched shards: %s", exc)

    def kinds(self, record: GlobalRecord) -> dict[int, str]:
        """Per shard of ``record``, where this rank reads it from (for the restore report)."""
        kinds = {}
        for shard in record.shards:
            found = self.place.find(shard.rank, shard.version)
            kinds[shard.rank] = found[0].value if found else "missing"
        return kinds

    # --- internals ----------------------------------------------------------------------------

    def _gather(self, records: bool) -> list[Holdings]:
        mine = Holdings(self.rank, self.place.readable(), bad=list(self.bad))
        if records and self.leader:
            try:
                good, _ = global_versions.valid_records(self.place.root, refuse_newer=True)
                mine.records = {r.version: r.to_bytes() for r in good}
            except UnsupportedCheckpoint as exc:  # the newest record of this root
                newest = max(global_versions.record_versions(self.place.root))
                mine.unsupported = (newest, str(exc))
            except CheckpointError as exc:  # e.g. global/ is a link: every rank stops
                mine.error = str(exc)
        if self.rank == 0 and self.remote is not None:
            if self._remote_listing is None:  # once per restore: nothing in it changes
                try:
                    self._remote_listing = self.remote.committed()
                except TierError as exc:  # the nodes' copies may do; decided in records()
                    self._remote_listing, self._remote_error = {}, str(exc)
            if records and not self._remote_error:
                try:
                    for version, raw in self.remote.records().items():
                        mine.records.setdefault(version, raw)
                except TierError as exc:
                    self._remote_error = str(exc)
            mine.remote, mine.remote_error = self._remote_listing, self._remote_error
        gathered: list[Any] = [None] * len(self.groups)
        with peers("restore: gathering what every rank holds"):
            dist.all_gather_object(gathered, mine, group=self._group)
        failed = next((h for h in gathered if h.error), None)
        if failed is not None:
            raise CheckpointError(f"rank {failed.rank}: {failed.error}")
        self._holdings = gathered
        return gathered

    def _run(
        self, record: GlobalRecord, transfers: list[Transfer], downloads: list[Download]
    ) -> None:
        pinned = {s.rank: s.manifest_crc32c for s in record.shards}
        for download in downloads:
            if download.reader == self.rank:
                self._download(download)
        for t in transfers:
            pin = pinned.get(t.src) if t.version == record.version else None
            if t.sender == self.rank:
                found = self.place.find(t.src, t.version)
                directory = found[1] if found else self.place.fetch_path(t.src, t.version)
                with peers("restore: sending a shard"):
                    self.report.sent_bytes += send_version(directory, t.receiver, self._group)
            elif t.receiver == self.rank:
                self._receive(t, pin)

    def _download(self, download: Download) -> None:
        assert self.remote is not None
        final = self.place.fetch_path(download.src, download.version)
        try:
            final = self.place.make_fetch_folder(download.src) / final.name
            _remove(final)
            self.remote.fetch(download.src, download.version, final)
        except (CheckpointError, TierError, OSError) as exc:
            with contextlib.suppress(OSError):
                _remove(final)
            self.bad.append((-1, download.src, download.version))
            log.warning(
                "restore: rank %d's shard of version %d could not be downloaded from the "
                "object store: %s",
                download.src,
                download.version,
                exc,
            )
            return
        self.report.remote_bytes += stored_data_bytes(final)

    def _receive(self, t: Transfer, pin: str | None) -> None:
        final = self.place.fetch_path(t.src, t.version)
        # A folder that cannot be made fails the receive, which refuses the copy in step
        # with its sender (raised here, the sender would wait for an answer): the copy is
        # staged where no folder can be made, never through what stood in the way.
        try:
            final = self.place.make_fetch_folder(t.src) / final.name
        except OSError:
            final = _NOWHERE / final.name
        staging = final.with_name(final.name + ".tmp")
        with contextlib.suppress(OSError):
            _remove(staging)
        try:
            with peers("restore: receiving a shard"):
                manifest = receive_version(t.sender, staging, self._group, pin)
            _remove(final)
            os.rename(staging, final)
        except (CheckpointError, ManifestError, OSError) as exc:
            if not isinstance(exc, ManifestError) and "another rank" in str(exc):
                raise  # the job is broken (a rank gone): no round can follow
            with contextlib.suppress(OSError):
                _remove(staging)
            self.bad.append((t.sender, t.src, t.version))
            log.warning(
                "restore: rank %d's copy of rank %d's shard of version %d was refused: %s",
                t.sender,
                t.src,
                t.version,
                exc,
            )
            return
        self.report.peer_bytes += manifest.stored_bytes


def plan_round(
    record: GlobalRecord, holdings: Sequence[Holdings], groups: Sequence[int]
) -> tuple[list[Transfer], list[Download], str]:
    """One round's transfers and downloads, the same on every rank; the third value says
    which shard is nowhere (the version cannot be had) or is ``""``."""
    world = len(holdings)
    readable: dict[tuple[int, int], list[int]] = defaultdict(list)  # (src, version) -> ranks
    base: dict[tuple[int, int], int] = {}
    for h in holdings:
        for src, versions in h.readable.items():
            for version, b in versions.items():
                readable[(src, version)].append(h.rank)
                base.setdefault((src, version), b)
    bad = {(holder, src, version) for h in holdings for holder, src, version in h.bad}
    remote = next((h.remote for h in holdings if h.remote is not None), None) or {}
    sizes = {s.rank: max(s.nbytes, 1) for s in record.shards}
    send_load, receive_load = [0] * world, [0] * world
    transfers: list[Transfer] = []
    downloads: list[Download] = []
    claimed: set[tuple[int, int]] = set()  # downloads planned this round
    members: dict[int, list[int]] = defaultdict(list)
    for rank in range(world):
        members[groups[rank]].append(rank)
    for group in sorted(members):
        ranks = members[group]
        for shard in record.shards:
            src, version = shard.rank, shard.version
            while version:
                key = (src, version)
                holders = [r for r in readable.get(key, []) if (r, src, version) not in bad]
                if not any(r in ranks for r in holders):
                    weight = sizes.get(src, 1)
                    if holders:
                        sender = spread(send_load, holders)
                        receiver = spread(receive_load, ranks)
                        send_load[sender] += weight
                        receive_load[receiver] += weight
                        transfers.append(Transfer(sender, receiver, src, version))
                    elif key in claimed:
                        pass  # downloaded this round by another root: sent to this one next
                    elif version in remote.get(src, []) and (-1, src, version) not in bad:
                        reader = spread(receive_load, ranks)
                        receive_load[reader] += weight
                        downloads.append(Download(reader, src, version))
                        claimed.add(key)
                    else:
                        where = "no rank holds it and it is not in the object store"
                        return (
                            [],
                            [],
                            (f"rank {src}'s shard of version {version} is nowhere ({where})"),
                        )
                version = base.get(key, 0)  # a delta's base, once some rank has read it
    return in_steps(transfers), downloads, ""


def in_steps(transfers: Sequence[Transfer]) -> list[Transfer]:
    """``transfers`` in the order every rank runs its own: step by step, each step a set
    of transfers no rank takes part in twice (a greedy colouring of the transfers).

    A send blocks until its receiver takes it, so a rank at a transfer waits for its
    partner to reach it. In sender order a rank's next transfer often waited for a partner
    busy with another rank: four nodes of one rank, one of them lost, took 9 turns for
    their 10 transfers, 6 in steps (the busiest rank's share). One order on every rank also
    rules out a deadlock: the first transfer not yet done always has both its ranks at it."""
    steps: list[set[int]] = []  # the ranks each step holds so far
    placed: list[tuple[int, Transfer]] = []
    for t in sorted(transfers, key=_order):
        step = next(
            (i for i, ranks in enumerate(steps) if not {t.sender, t.receiver} & ranks),
            len(steps),
        )
        if step == len(steps):
            steps.append(set())
        steps[step] |= {t.sender, t.receiver}
        placed.append((step, t))
    return [t for _, t in sorted(placed, key=lambda p: (p[0], _order(p[1])))]


def _order(t: Transfer) -> tuple[int, int, int, int]:
    return (t.sender, t.receiver, t.src, t.version)


def _entries(folder: Path) -> list[tuple[int, int, Path]]:
    """``(src, version, path)`` of every entry of every ``rank-<src>/`` folder under
    ``folder``; ``version`` is 0 for an entry that is not a version's folder (a leftover, a
    link, a name pcframe does not write such as ``v000000003``). A ``rank-<src>`` that is a
    link or not spelled as pcframe spells it is passed over, never listed through."""
    found = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        match = RANK_DIR.match(name)
        if not match or name != rank_dirname(int(match.group(1))):
            continue
        if not is_real_directory(folder / name):
            continue
        try:
            entries = os.listdir(folder / name)
        except OSError:
            continue
        for entry in entries:
            path = folder / name / entry
            version = version_number(entry, str(path)) if is_real_directory(path) else None
            found.append((int(match.group(1)), version or 0, path))
    return found


def _shards(folder: Path) -> list[tuple[int, int, Path]]:
    """``(src, version, path)`` of every complete shard folder under ``folder``."""
    return [
        (src, version, path)
        for src, version, path in _entries(folder)
        if version and (path / MANIFEST_NAME).is_file()
    ]


def fetch_chain(
    root: Path, peer_base: Path | None, fetch_dir: Path | None
) -> tuple[Path, tuple[str, ...]]:
    """A fetched folder as the folder its user named (the root, or the node's peer folder:
    either may be a link) and the names pcframe made below it (none may be)."""
    if fetch_dir is None:
        return root, (FETCHED,)
    if peer_base is None or not fetch_dir.is_relative_to(peer_base):
        return fetch_dir, ()  # a folder given as such (no peer folder above it)
    return peer_base, fetch_dir.relative_to(peer_base).parts


def _real_below(top: Path, names: Sequence[str]) -> bool:
    """Whether each of ``names`` below ``top`` is a directory, none of them a link."""
    path = top
    for name in names:
        path = path / name
        if not is_real_directory(path):
            return False
    return True


def _own_folder(top: Path, names: Sequence[str]) -> Path:
    """``top/names...``, each level made a directory of pcframe's own: a link or a file in
    its place is unlinked (never followed), so nothing is written or deleted through it."""
    top.mkdir(parents=True, exist_ok=True)  # the folder the user named: it may be a link
    path = top
    for name in names:
        path = path / name
        if os.path.lexists(path) and not is_real_directory(path):
            os.unlink(path)
        path.mkdir(exist_ok=True)
    return path


def _remove(path: Path) -> None:
    """Remove a fetched entry: a link or a file is unlinked (what it points to stays), a
    directory deleted with what it holds."""
    if is_real_directory(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _base_of(path: Path) -> int:
    try:
        return delta_base(path)
    except (ManifestError, OSError):  # unreadable: it bases nothing here (its read says why)
        return 0
