"""Where DCP checkpoints live in a pcframe root, and how a multi-rank one is committed.

A root written by one rank is an ordinary pcframe checkpoint directory (``root/vNNNNNNNN``),
so ``pcframe list / verify / inspect / export root`` work on it directly. A root written by
several ranks has the layout of :mod:`pcframe.distributed.record`: every rank's shard is a
pcframe version in ``root/rank-<r>/vNNNNNNNN`` (its own parallel writers, checksums and
crash-safe local commit) and the coordinator writes ``root/global/vNNNNNNNN.json``, the
commit point of the whole version, once every rank's shard is durable. Once a root has a
global record it stays multi-rank (a later one-rank save writes ``rank-0`` and a record),
so its versions are numbered and retained as one sequence.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pcframe.distributed import record as rec
from pcframe.distributed.index import SavedIndex
from pcframe.errors import CheckpointError, ManifestError
from pcframe.faults import crash_point
from pcframe.format.manifest import MANIFEST_NAME, Manifest, read_manifest
from pcframe.format.stripes import stored_data_bytes
from pcframe.store.directory import CheckpointDir

log = logging.getLogger("pcframe")

PLAIN = "plain"  # root/vN: one rank
RANKS = "ranks"  # root/rank-<r>/vN + root/global/vN.json
_RANK_DIR = re.compile(r"^rank-(\d{1,7})$")


def layout_for(root: Path, world_size: int) -> str:
    """The layout a save of ``world_size`` ranks uses in ``root``."""
    return RANKS if world_size > 1 or rec.record_versions(root) else PLAIN


def shard_dir(root: Path, layout: str, rank: int) -> Path:
    """The pcframe directory rank ``rank`` writes its version into."""
    return root if layout == PLAIN else root / rec.rank_dirname(rank)


def next_version(root: Path) -> int:
    """One above every version number the root has used (plain, rank shards, records, hints).

    A number is never reused, even for a version a crash left behind on one rank only.
    """
    used = rec.record_versions(root)
    pointer = rec.read_pointer(root)
    directories = [CheckpointDir(root)]
    if root.is_dir():
        directories += [CheckpointDir(root / n) for n in os.listdir(root) if _RANK_DIR.match(n)]
    for directory in directories:
        used += directory.committed_versions()
        used.append(directory.latest_hint() or 0)
    return max([pointer or 0, *used], default=0) + 1


class GlobalShards:
    """Retention reason of a rank's directory: the shards some global version may still need.

    A shard is kept while a global record names its version, or while it is newer than the
    newest record (its global version is not decided yet). Records are read from disk at
    each commit, so every rank sees what the coordinator pruned.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def keep(self, committed: Sequence[int]) -> set[int]:
        records = set(rec.record_versions(self.root))
        newest = max(records, default=0)
        return {v for v in committed if v in records or v > newest}


def publish_global(root: Path, version: int, step: int, world_size: int, keep: int) -> None:
    """Coordinator: commit ``version`` once every rank's shard of it is committed.

    Writes the global record durably (the commit point), then the GLOBAL pointer, then
    deletes records beyond the newest ``keep``; the ranks' own retention deletes the shards
    no record needs at their next save.

    Raises:
        CheckpointError: a rank's shard of ``version`` is missing (nothing is published).
    """
    rec.remove_partial_records(root)
    shards = []
    for rank in range(world_size):
        directory = CheckpointDir(root / rec.rank_dirname(rank)).path(version)
        manifest = directory / MANIFEST_NAME
        if not manifest.is_file():
            raise CheckpointError(
                f"{directory}: rank {rank}'s shard of version {version} is not committed; "
                "the version is not published (the previous one stays the newest)"
            )
        shards.append(
            rec.ShardRef(
                rank=rank,
                directory=rec.rank_dirname(rank),
                version=version,
                step=step,
                manifest_crc32c=rec.manifest_crc(manifest),
                nbytes=stored_data_bytes(directory),
            )
        )
    record = rec.GlobalRecord(version, step, time.time(), world_size, tuple(shards))
    rec.write_record(root, record)
    crash_point("global_record_written")
    try:
        rec.write_pointer(root, version)
    except OSError as exc:  # the record is the commit point; GLOBAL is a hint
        log.warning("could not update %s: %s", root / rec.POINTER, exc)
    for old in rec.record_versions(root)[:-keep]:
        try:
            rec.delete_record(root, old)
        except OSError as exc:
            log.warning("could not delete global record v%d: %s", old, exc)


@dataclass(frozen=True)
class Committed:
    """One committed version of a root, ready to read: rank -> (directory, manifest)."""

    version: int
    step: int
    directories: dict[int, Path]
    manifests: dict[int, Manifest]

    @property
    def where(self) -> str:
        return str(self.directories[0]) if len(self.directories) == 1 else f"version {self.version}"


def candidates(root: Path) -> list[int]:
    """Every committed version of the root (plain versions and global records), newest first."""
    return sorted({*CheckpointDir(root).committed_versions(), *rec.record_versions(root)})[::-1]


def open_version(root: Path, version: int) -> Committed:
    """Read and validate the manifests of ``version`` (every shard's, pinned by its record).

    Raises:
        ManifestError / CorruptCheckpoint: naming the file; OSError: it cannot be read.
    """
    if version in rec.record_versions(root):
        record = rec.read_record(rec.record_path(root, version))
        index = SavedIndex(root, record)  # checks each shard against the record's checksum
        directories = {r: index.directory(r) for r in index.manifests}
        return Committed(version, record.step, directories, dict(index.manifests))
    directory = CheckpointDir(root).path(version)
    manifest = read_manifest(str(directory / MANIFEST_NAME))
    if manifest.version != version:
        raise ManifestError(
            f"{directory / MANIFEST_NAME}: 'version' is {manifest.version}, but the folder is "
            f"{directory.name}"
        )
    return Committed(version, manifest.step, {0: directory}, {0: manifest})
