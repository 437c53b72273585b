"""The peer tier's store on one rank: copies of other ranks' shards, in this node's memory.

A spot preemption takes a VM with its local disk and its memory, so the newest versions are
safe only once they are on another node. Each rank keeps, in a folder of its node's memory
(``/dev/shm`` by default: it outlives the worker process, so a job restarted on this node
finds it), verified copies of the shards of the ranks it backs up
(:func:`pcframe.distributed.nodes.backed_up_by`)::

    <directory>/rank-<src>/vNNNNNNNN/    an exact copy of rank src's shard directory
    <directory>/rank-<src>/vNNNNNNNN.tmp  a copy on its way (never listed; swept at start)
    <directory>/.spare/                  the files of the last copy dropped (never listed)
    <directory>/.spare/shadow.json       the spare filled ahead for one copy (a shadow)

A copy is written into ``.tmp`` by :func:`~pcframe.distributed.shard_stream.receive_version`
(every piece checked) and renamed into place, so a listed copy is complete. The store holds
at most ``budget`` bytes (every file of a copy counts: data, codec segments, manifest), the
spare included: before a copy is received the oldest copies beyond ``keep`` per rank go,
then the oldest others, but never the base of a delta copy it keeps, nor the copies of the
version the replication *pinned* (the newest one every shard of which reached its peers: what
a restore after losing a node falls back to while newer rounds are incomplete); a copy that
does not fit even then is declined (the sender is told, nothing waits). A held copy whose
manifest is not the one offered (left by an earlier job at the same root that numbered its
versions from 1 again) is dropped, not taken for the offered version.

A copy dropped to make room or beyond ``keep`` is not deleted but becomes the spare: the
next copy received is written over its files, so it lands in memory the node already holds
(allocating and zeroing fresh ``/dev/shm`` pages, and freeing the old ones, was half the
receiver's CPU). What the next copy does not reuse is deleted when it is committed. While a
restore of any rank of the node reads the copies (:meth:`PeerStore.reading`: a marker
beside the stores), a copy that goes is deleted instead: a file made the spare is
truncated and overwritten in place, under any map a reader holds of it, while a deleted
file stays readable through the descriptors and maps already open.
The spare may also be filled *ahead* of a copy (:meth:`PeerStore.prepare_shadow`): where a
rank holds the same replicated state as the rank it backs up (DDP), it writes that state
into the spare at each save, laid out as that rank's newest copy here lays it out, and the
copy's pieces that check need not travel (:mod:`pcframe.distributed.shadow`). The fill and
the peer round both hold :attr:`PeerStore.spare_lock`, so one never writes the files the
other reads. :class:`PeerStore` is this bookkeeping; the transfers are
:mod:`pcframe.distributed.replication`'s.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pcframe.errors import TierError
from pcframe.format.manifest import delta_base, manifest_crc
from pcframe.format.names import MANIFEST_NAME, RANK_DIR, VERSION_DIR, version_name
from pcframe.store.tiers.memory import SHM

log = logging.getLogger("pcframe.store.tiers")

SPARE_DIR = ".spare"
# In the spare: whose copy its data files were filled for ahead of the copy (a shadow,
# pcframe.distributed.shadow); written after the fill, never part of a copy.
SHADOW_MARK = "shadow.json"
READING_PREFIX = ".reading-"  # beside the stores of a node: a restore reads their copies

DEFAULT_BUDGET_SHARE = 0.5  # of the memory file system's free space when no budget is given


@dataclass(frozen=True)
class Shadow:
    """What a fill wrote into the spare ahead of one copy: the data files it laid out, and
    the chunks (indices in the manifest) it wrote whole, tensor bytes and the zeros between
    them. Only those chunks are worth checking: any other byte is an older copy's."""

    files: frozenset[str]
    chunks: frozenset[int]


def copy_bytes(directory: Path) -> int:
    """Bytes of every file of a version directory (manifest, data stripes, codec segments):
    what a copy of it takes of a node's memory.

    Raises:
        OSError: the folder cannot be listed.
    """
    total = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def default_peer_directory(root: Path, base: Path = SHM) -> Path:
    """Where a job writing ``root`` keeps peer copies on this node: the same folder for every
    restart of the job (named after the root), a different one for another job, inside a
    folder of this user's own (``pcframe-peers-<uid>``, made and checked by
    :func:`private_folder` where the peer tier is used)."""
    key = hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:12]
    return Path(base) / f"pcframe-peers-{os.getuid()}" / key


def private_folder(folder: Path) -> Path:
    """Make ``folder`` (mode 0700) or check that it is this user's own: ``/dev/shm`` is
    shared by every user of the node, and a folder another user made there first would let
    them read the copies, or plant files that a restore reads and sets a version aside for.

    Raises:
        TierError: it cannot be made, or it is not this user's private folder (made by
            someone else, a link, or open to others).
    """
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        info = os.lstat(folder)
    except OSError as exc:
        raise TierError(
            f"peer tier: cannot make {folder} ({exc.strerror}); give peer_dir= a writable "
            "folder in this node's memory"
        ) from None
    mine = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
    if not mine or info.st_mode & 0o077:
        raise TierError(
            f"peer tier: {folder} is not this user's private folder (owner uid "
            f"{info.st_uid}, mode {stat.filemode(info.st_mode)}): another user may have "
            "made it; remove it, or give peer_dir= a folder of your own"
        )
    return folder


class PeerStore:
    """Verified copies of other ranks' shards on this rank, within ``budget`` bytes.

    Args:
        directory: this rank's folder of copies (created; ``rank-<src>/`` inside).
        budget: bytes of copies held at most (``None``: half the free space of the file
            system the folder is on, measured at start, shared by ``sharers``).
        keep: copies kept per backed-up rank (the newest; the bases of delta copies too).
        sharers: the stores on this node's memory file system (one per rank on the node):
            the default budget is split between them, so that together they never take
            more than half of it.
    """

    def __init__(
        self, directory: Path, budget: int | None = None, keep: int = 2, sharers: int = 1
    ) -> None:
        if keep < 1:
            raise TierError(f"peer tier: keep={keep} must be >= 1")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierError(
                f"peer tier: cannot create {self.directory} ({exc.strerror}); give "
                "peer_dir= a writable folder in this node's memory (e.g. under /dev/shm)"
            ) from exc
        if budget is None:
            free = shutil.disk_usage(self.directory).free
            budget = int(free * DEFAULT_BUDGET_SHARE / max(sharers, 1))
        if budget < 0:
            raise TierError(f"peer tier: budget={budget} bytes must be >= 0")
        self.budget, self.keep = int(budget), keep
        self.pinned = 0  # a version whose copies stay (0: none; see pin)
        self._lock = threading.Lock()
        # Held while the spare is filled ahead of a copy or used by a peer round.
        self.spare_lock = threading.Lock()
        self.swept = self._sweep()

    # --- listing ---------------------------------------------------------------------------

    def path(self, src: int, version: int) -> Path:
        return self.directory / f"rank-{src}" / version_name(version)

    def held(self) -> dict[int, list[int]]:
        """Complete copies by backed-up rank: ``{src: [versions, oldest first]}``."""
        found: dict[int, list[int]] = {}
        for src, _, names in self._rank_folders():
            versions = [int(v.group(1)) for v in map(VERSION_DIR.match, names) if v]
            if versions:
                found[src] = sorted(versions)
        return found

    def _rank_folders(self) -> Iterator[tuple[int, Path, list[str]]]:
        """``(src, folder, names in it)`` of every ``rank-N`` folder of the store. Anything
        else of that name (a file, a link, a folder removed meanwhile) is not a copy of
        anything and is passed over: one stray file must not stop the replication."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            match = RANK_DIR.match(name)
            folder = self.directory / name
            if not match or folder.is_symlink():
                continue
            try:
                inside = os.listdir(folder)
            except (FileNotFoundError, NotADirectoryError):
                continue
            yield int(match.group(1)), folder, inside

    def held_bytes(self) -> int:
        return sum(self._size(src, v) for src, versions in self.held().items() for v in versions)

    @property
    def spare(self) -> Path:
        """The files of the last copy dropped, for the next one received to reuse."""
        return self.directory / SPARE_DIR

    def spare_bytes(self) -> int:
        try:
            return copy_bytes(self.spare)
        except OSError:
            return 0

    # --- receiving -------------------------------------------------------------------------

    def admit(
        self, offers: Mapping[int, Sequence[tuple[int, int, str]]]
    ) -> dict[int, list[int] | None]:
        """What to receive of what the backed-up ranks offer: ``offers`` maps a rank to its
        chain ``[(version, bytes, manifest crc)]`` (a delta version's bases first); the
        answer maps it to the versions of that chain not held here (``[]``: nothing to
        receive), or ``None`` where they do not fit (declined). A held copy whose manifest
        checksum is not the one offered is dropped first (another shard of that number).

        Room is made for every admitted chain together, in the order given: a later rank's
        copies never prune a base an earlier rank's chain reads, and the copies of all of
        them fit in the budget while they arrive one after another.
        """
        answer: dict[int, list[int] | None] = {}
        admitted, reads = 0, set[tuple[int, int]]()
        for src, chain in offers.items():
            self._drop_stale(src, chain)
            held = set(self.held().get(src, []))  # again: room made for a rank before may prune
            missing = [(v, n) for v, n, _ in chain if v not in held]
            if not missing:
                answer[src] = []
                continue
            these = {(src, v) for v, _, _ in chain if v in held}
            need = sum(n for _, n in missing)
            if not self.make_room(admitted + need, reads | these):
                answer[src] = None
                continue
            admitted, reads = admitted + need, reads | these
            answer[src] = [v for v, _ in missing]
        return answer

    def pin(self, version: int) -> None:
        """Keep the copies of ``version`` (and their bases) whatever room is needed, until
        another version is pinned: the replication pins the newest version every shard of
        which reached its peers, so a node lost while newer rounds are incomplete (a peer
        that declined or failed them) still comes back from that version."""
        with self._lock:
            self.pinned = version

    def make_room(self, nbytes: int, reads: Collection[tuple[int, int]] = ()) -> bool:
        """Prune so that ``nbytes`` of incoming copies fit (a delta version's missing bases
        and itself, together; several ranks' at once); False if they do not fit even with
        every prunable copy gone (they are then declined).

        The pinned version's copy of a rank stays, and where there is none, its newest copy
        stays until a newer one is in place (a failed transfer never costs the last good
        copy); a newer copy than the pinned one may go, as it is not known to be part of a
        whole version: kept instead, it would take the room of the copies that could make
        the next one whole, and one failed round would stop the replication for good where
        the budget holds three copies or fewer. Every base a kept delta copy reads stays too,
        and ``reads``: the held copies ``(src, version)`` the incoming copies read.
        While a copy is received the store holds the copies kept and the larger of the spare
        and the copies (written over the spare's files): that is what must fit.
        """
        with self._lock:
            if nbytes > self.budget:
                return False
            held = self.held()
            used = sum(self._size(s, v) for s, vs in held.items() for v in vs)
            spare = self.spare_bytes()
            # Per rank its pinned copy where it holds one, else its newest.
            kept = {(s, self.pinned if self.pinned in vs else vs[-1]) for s, vs in held.items()}
            kept |= self._bases_needed(held) | set(reads)
            for v, s in sorted((v, s) for s, vs in held.items() for v in vs):  # oldest first
                if used + max(spare, nbytes) <= self.budget:
                    break
                if (s, v) not in kept:
                    spare = self._size(s, v)
                    used -= spare
                    self._retire(s, v)
            if used + max(spare, nbytes) > self.budget and spare:  # a spare larger than the copy
                self._drop_spare()
                spare = 0
            return used + max(spare, nbytes) <= self.budget

    def staging(self, src: int, version: int) -> Path:
        """A fresh ``.tmp`` folder path for a copy (any leftover there removed).

        Raises:
            OSError: the rank's folder cannot be made, or is a link (copies written through
                it would be neither listed nor pruned: memory without bound).
        """
        staging = self.path(src, version).with_name(f"{version_name(version)}.tmp")
        if staging.parent.is_symlink():
            raise OSError(errno.ELOOP, "a link, not a folder of copies", str(staging.parent))
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(parents=True, exist_ok=True)
        return staging

    def commit(self, src: int, version: int, staging: Path) -> None:
        """The verified copy in ``staging`` becomes listed (replacing an older copy of it);
        what it left of the spare is deleted, and a copy beyond ``keep`` becomes the spare."""
        final = self.path(src, version)
        with self._lock:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(staging, final)
            self._drop_spare()
            try:  # the copy is in place: a store that cannot be listed keeps one too many
                self._prune_beyond_keep(src)
            except OSError as exc:
                log.warning("peer tier: could not prune the copies of rank %d: %s", src, exc)

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    # --- filling the spare ahead of a copy (a shadow) ---------------------------------------

    def prepare_shadow(self, sizes: Mapping[str, int], nbytes: int) -> Path | None:
        """The spare made ready to be filled ahead of a copy of ``nbytes`` (every file):
        room made for it as for a copy received (:meth:`make_room`: the spare is what the
        copy will be written over), its files named and sized as ``sizes`` (the copy's
        data files) and nothing else left in it. None where the copy would not fit. The
        caller holds :attr:`spare_lock` and marks the fill done with :meth:`mark_shadow`.

        Raises:
            OSError: the spare's files cannot be made.
        """
        if not self.make_room(nbytes):
            return None
        with self._lock:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.spare / SHADOW_MARK)
            self.spare.mkdir(exist_ok=True)
            for name, size in sorted(sizes.items(), key=lambda item: -item[1]):
                target = self.spare / name
                if not target.exists():  # the largest other file's pages, else new ones
                    others = sorted(
                        (p for p in self.spare.iterdir() if p.name not in sizes),
                        key=lambda p: p.stat().st_size,
                        reverse=True,
                    )
                    if others:
                        os.rename(others[0], target)
                with open(target, "ab") as handle:  # created where it is not there
                    handle.truncate(size)
            for leftover in self.spare.iterdir():  # the room made is for these files only
                if leftover.name not in sizes:
                    leftover.unlink()
        return self.spare

    def mark_shadow(self, src: int, version: int, shadow: Shadow) -> None:
        """The spare now holds what ``shadow`` says of ``src``'s ``version``."""
        mark = {
            "src": src,
            "version": version,
            "files": sorted(shadow.files),
            "chunks": sorted(shadow.chunks),
        }
        (self.spare / SHADOW_MARK).write_text(json.dumps(mark))

    def shadow_of(self, src: int, version: int) -> Shadow | None:
        """What the spare holds, filled ahead, of ``src``'s ``version`` (None where it was
        filled for another copy, or not at all)."""
        try:
            mark = json.loads((self.spare / SHADOW_MARK).read_text())
            if mark["src"] == src and mark["version"] == version:
                files = frozenset(str(name) for name in mark["files"])
                return Shadow(files, frozenset(int(index) for index in mark["chunks"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    # --- the restore's side ---------------------------------------------------------------

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """While a restore reads this node's copies: no store of the node (they share the
        parent folder) makes a copy it lets go the spare; they delete it. A marker left by
        a process killed meanwhile only costs that saving until its next restore ends."""
        marker = self.directory.parent / f"{READING_PREFIX}{self.directory.name}"
        with contextlib.suppress(OSError):
            marker.touch()
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                marker.unlink()

    # --- internals ---------------------------------------------------------------------------

    def _size(self, src: int, version: int) -> int:
        try:
            return copy_bytes(self.path(src, version))
        except OSError:
            return 0

    def _drop_stale(self, src: int, chain: Sequence[tuple[int, int, str]]) -> None:
        """Drop held copies of ``src`` whose manifest is not the offered one (``crc``)."""
        held = set(self.held().get(src, []))
        for version, _, crc in chain:
            if version not in held or not crc:
                continue
            try:
                same = manifest_crc(self.path(src, version) / MANIFEST_NAME) == crc
            except Exception:  # unreadable: not the offered copy either
                same = False
            if not same:
                log.warning(
                    "peer tier: the copy of rank %d's version %d held here is not the one it "
                    "offers (left by an earlier job?): dropped",
                    src,
                    version,
                )
                with self._lock:
                    self._remove(src, version)

    def _remove(self, src: int, version: int) -> None:
        shutil.rmtree(self.path(src, version), ignore_errors=True)

    def _retire(self, src: int, version: int) -> None:
        """Unlist a copy and keep its files as the spare (replacing the spare before), or
        delete it while a restore reads the node's copies (:meth:`reading`)."""
        self._drop_spare()
        if self._being_read():
            self._remove(src, version)
            return
        try:
            os.rename(self.path(src, version), self.spare)
        except OSError:
            self._remove(src, version)

    def _being_read(self) -> bool:
        try:
            return any(
                name.startswith(READING_PREFIX) for name in os.listdir(self.directory.parent)
            )
        except OSError:
            return True  # cannot tell: deleting is always safe

    def _drop_spare(self) -> None:
        shutil.rmtree(self.spare, ignore_errors=True)

    def _prune_beyond_keep(self, src: int) -> None:
        versions = self.held().get(src, [])
        keep = set(versions[-self.keep :]) | ({self.pinned} & set(versions))
        keep |= {b for s, b in self._bases_needed({src: sorted(keep)}) if s == src}
        for version in versions:
            if version not in keep:
                self._retire(src, version)

    def _bases_needed(self, held: dict[int, list[int]]) -> set[tuple[int, int]]:
        """``(src, version)`` of every base a held delta copy reads (its whole chain)."""
        needed: set[tuple[int, int]] = set()
        for src, versions in held.items():
            for version in versions:
                current = version
                while True:
                    try:
                        current = delta_base(self.path(src, current))
                    except Exception:  # a copy that cannot be read bases nothing
                        break
                    if not current:
                        break
                    needed.add((src, current))
        return needed

    def _sweep(self) -> list[str]:
        """Remove copies left half-received by a process that died (``*.tmp``), and its
        spare."""
        self._drop_spare()
        removed = []
        with contextlib.suppress(OSError):  # a file or link named like a rank's folder: no
            # copy, and in its place no copy of that rank could be made (every round refused)
            for entry in os.scandir(self.directory):
                if RANK_DIR.match(entry.name) and not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.path)
                    log.warning("peer tier: removed %s (not a folder of copies)", entry.path)
                    removed.append(entry.name)
        for _, folder, names in self._rank_folders():
            for leftover in names:
                if leftover.endswith(".tmp"):
                    shutil.rmtree(folder / leftover, ignore_errors=True)
                    removed.append(f"{folder.name}/{leftover}")
        return removed
