"""Where DCP checkpoints live in a pcframe root, and how a multi-rank one is committed.

A root written by one rank is an ordinary pcframe checkpoint directory (``root/vNNNNNNNN``),
so ``pcframe list / verify / inspect / export root`` work on it directly. A root written by
several ranks has the layout of :mod:`pcframe.distributed.global_versions`: every rank's shard is a
pcframe version in ``root/rank-<r>/vNNNNNNNN`` (its own parallel writers, checksums and
crash-safe local commit) and the coordinator writes ``root/global/vNNNNNNNN.json``, the
commit point of the whole version, once every rank's shard is durable. Once a root has a
global record it stays multi-rank (a later one-rank save writes ``rank-0`` and a record),
so its versions are numbered and retained as one sequence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from pcframe.distributed import global_versions
from pcframe.distributed.index import SavedIndex
from pcframe.errors import CheckpointError, CorruptCheckpoint, ManifestError
from pcframe.format.manifest import MANIFEST_NAME, Manifest, read_manifest
from pcframe.store.directory import CheckpointDir

log = logging.getLogger("pcframe")

PLAIN = "plain"  # root/vN: one rank
RANKS = "ranks"  # root/rank-<r>/vN + root/global/vN.json


def layout_for(root: Path, world_size: int) -> str:
    """The layout a save of ``world_size`` ranks uses in ``root``."""
    return RANKS if world_size > 1 or global_versions.record_versions(root) else PLAIN


def shard_dir(root: Path, layout: str, rank: int) -> Path:
    """The pcframe directory rank ``rank`` writes its version into."""
    return root if layout == PLAIN else root / global_versions.rank_dirname(rank)


def publish_global(root: Path, version: int, step: int, world_size: int, keep: int) -> None:
    """Coordinator: commit ``version`` once every rank's shard of it is committed
    (:func:`~pcframe.distributed.global_versions.publish`, keeping ``keep`` records).

    Raises:
        CheckpointError: a rank's shard of ``version`` is missing (nothing is published).
    """
    global_versions.remove_partial_records(root)
    shards = []
    for rank in range(world_size):
        directory = CheckpointDir(root / global_versions.rank_dirname(rank)).path(version)
        if not (directory / MANIFEST_NAME).is_file():
            raise CheckpointError(
                f"{directory}: rank {rank}'s shard of version {version} is not committed; "
                "the version is not published (the previous one stays the newest)"
            )
        shards.append(global_versions.shard_ref(root, rank, version, step))
    record = global_versions.GlobalRecord(version, step, time.time(), world_size, tuple(shards))
    global_versions.publish(root, record, keep)


@dataclass(frozen=True)
class Committed:
    """One committed version of a root, ready to read: rank -> (directory, manifest)."""

    version: int
    step: int
    directories: dict[int, Path]
    manifests: dict[int, Manifest]
    world_size: int  # the ranks that saved it (1 for a root written by one rank)
    record: Path | None = None  # its global record (a multi-rank root)

    @property
    def where(self) -> str:
        return str(self.directories[0]) if len(self.directories) == 1 else f"version {self.version}"

    def manifest_path(self, rank: int) -> str:
        return str(self.directories[rank] / MANIFEST_NAME)


def candidates(root: Path) -> list[int]:
    """Every committed version of the root (plain versions and global records), newest first."""
    return sorted(
        {*CheckpointDir(root).committed_versions(), *global_versions.record_versions(root)}
    )[::-1]


def open_version(root: Path, version: int) -> Committed:
    """Read and validate the manifests of ``version`` (every shard's, pinned by its record).

    Raises:
        UnsupportedCheckpoint: a record or manifest of a newer format.
        ManifestError / CorruptCheckpoint: naming the file (a missing file included);
        OSError: a file cannot be read.
    """
    try:
        if version in global_versions.record_versions(root):
            record = global_versions.read_record(global_versions.record_path(root, version))
            index = SavedIndex(root, record)  # checks each shard against the record's checksum
            directories = {r: index.directory(r) for r in index.manifests}
            manifests = dict(index.manifests)
            where = global_versions.record_path(root, version)
            return Committed(version, record.step, directories, manifests, record.world_size, where)
        directory = CheckpointDir(root).path(version)
        manifest = read_manifest(str(directory / MANIFEST_NAME))
    except (FileNotFoundError, NotADirectoryError) as exc:
        # A file or folder the version needs is not there: damage, or a live writer's
        # retention that deleted it meanwhile (the reader tells which by listing again).
        raise CorruptCheckpoint(f"{exc.filename}: missing ({exc.strerror})") from None
    if manifest.version != version:
        raise ManifestError(
            f"{directory / MANIFEST_NAME}: 'version' is {manifest.version}, but the folder is "
            f"{directory.name}"
        )
    return Committed(version, manifest.step, {0: directory}, {0: manifest}, 1)
