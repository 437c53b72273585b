"""Global versions of a multi-rank checkpoint: the record, publishing it, retention, numbers.

One home for both writers of multi-rank roots: :class:`~pcframe.distributed.
DistributedCheckpointer` (its commit protocol, :mod:`pcframe.distributed.protocol`) and the
DCP ``StorageWriter`` on several ranks (:mod:`pcframe.integrations.dcp.writer`).

Layout of a distributed checkpoint root::

    root/
      GLOBAL                 newest published global version, e.g. "v00000012" (a hint)
      global/v00000012.json  the global record of version 12: its commit point
      rank-0/                rank 0's local pcframe directory (v00000012/, LATEST, ...)
      rank-1/

Rank 0 writes ``global/vNNNNNNNN.json`` only after every rank reported its shard of that
version durably committed, so the record's existence means the whole version is on disk.
The file is written durably (tmp, fsync, rename, fsync the directory) under the one-line
integrity header of :mod:`pcframe.format.envelope`, as a manifest is, with the JSON body::

    {"version": 12, "step": 120, "wall_time": ..., "world_size": 2,
     "shards": [{"rank": 0, "directory": "rank-0", "version": 12, "step": 120,
                 "manifest_crc32c": "1a2b3c4d", "nbytes": 123}, ...]}

``manifest_crc32c`` is the body checksum from the shard's manifest header: a restore refuses
a shard directory that was replaced by a different one of the same version number.

:func:`publish` is the commit of a global version (record, then pointer, then older records
beyond ``keep`` pruned); :func:`retention_allowed` and :class:`GlobalShards` say which local
shards a rank's retention may delete; :func:`next_version` numbers a new version above
every one a root has used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pcframe.errors import (
    CheckpointError,
    CorruptCheckpoint,
    ManifestError,
    NotRegularFile,
    UnsupportedCheckpoint,
)
from pcframe.format.envelope import BodyFields, Envelope, is_crc, seal
from pcframe.format.files import read_small
from pcframe.format.manifest import MANIFEST_NAME, manifest_crc
from pcframe.format.names import RANK_DIR, version_from_digits, version_name, version_number
from pcframe.format.stripes import stored_data_bytes
from pcframe.runtime.faults import crash_point
from pcframe.store.directory import (
    QUARANTINE_PREFIX,
    CheckpointDir,
    fsync_dir,
    write_file_durably,
    write_new_file,
)

log = logging.getLogger("pcframe")

FORMAT = "pcframe-global"
FORMAT_VERSION = 1
POINTER = "GLOBAL"
RECORDS = "global"
MAX_RECORD_BYTES = 16 * 1024 * 1024
MAX_WORLD_SIZE = 1 << 20
_RECORD_NAME = re.compile(r"^v(\d{8,})\.json$")
GLOBAL_RECORD = Envelope(
    FORMAT,
    (FORMAT_VERSION,),
    "global record",
    fix="delete this file to fall back to the previous global version",
)


def rank_dirname(rank: int) -> str:
    return f"rank-{rank}"


@dataclass(frozen=True)
class ShardRef:
    """One rank's part of a global version."""

    rank: int
    directory: str
    version: int
    step: int
    manifest_crc32c: str
    nbytes: int


@dataclass(frozen=True)
class GlobalRecord:
    version: int
    step: int
    wall_time: float
    world_size: int
    shards: tuple[ShardRef, ...]

    def to_bytes(self) -> bytes:
        body = {
            "version": self.version,
            "step": self.step,
            "wall_time": self.wall_time,
            "world_size": self.world_size,
            "shards": [asdict(s) for s in self.shards],
        }
        return seal(FORMAT, FORMAT_VERSION, body)


def records_dir(root: Path) -> Path:
    """The root's folder of global records, refused if it is a link: records are read and
    written in the root itself (a planted link would have them read from, and written to,
    anywhere)."""
    directory = root / RECORDS
    if os.path.islink(directory):
        raise CheckpointError(
            f"{directory} is a link: pcframe never reads or writes a checkpoint's global "
            "records through one; put the folder it points to in its place"
        )
    return directory


def record_path(root: Path, version: int) -> Path:
    return records_dir(root) / f"{version_name(version)}.json"


def record_versions(root: Path) -> list[int]:
    """Versions that have a global record file, oldest first (validity not checked)."""
    try:
        names = os.listdir(records_dir(root))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = _RECORD_NAME.match(name)
        version = version_from_digits(match.group(1), name) if match else None
        if version is not None:
            found.append(version)
    return sorted(found)


def write_record(root: Path, record: GlobalRecord) -> None:
    """Write the record durably: after this returns, the global version survives a crash."""
    directory = records_dir(root)
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(root)
    write_file_durably(record_path(root, record.version), record.to_bytes())


def delete_record(root: Path, version: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record_path(root, version))
        fsync_dir(records_dir(root))


def quarantine_record(root: Path, version: int, reason: str = "") -> None:
    """Move the record of a global version that failed verification out of the listing.

    It is kept as ``global/.corrupt-vNNNNNNNN-<pid>.json`` (and ``reason`` beside it, as
    ``….why``), so the version no longer counts as one of the ``keep_global`` retained
    versions, and ``pcframe list`` does not show it as a version (it names it as set aside).
    On read-only media it stays listed and is skipped again by the next restore.
    """
    stem = f"{QUARANTINE_PREFIX}{version_name(version)}-{os.getpid()}"
    try:
        os.rename(record_path(root, version), records_dir(root) / f"{stem}.json")
        fsync_dir(records_dir(root))
    except OSError:
        return
    if reason:  # best effort: the record is out of the listing whether or not this lands
        with contextlib.suppress(OSError):
            write_new_file(records_dir(root) / f"{stem}.why", f"{reason}\n".encode())


def set_aside_records(root: Path) -> list[tuple[str, str]]:
    """``(file, why)`` of every global record a restore set aside as damaged."""
    try:
        names = sorted(os.listdir(records_dir(root)))
    except OSError:
        return []
    found = []
    for name in names:
        if name.startswith(f"{QUARANTINE_PREFIX}v") and name.endswith(".json"):
            why = records_dir(root) / f"{name[: -len('.json')]}.why"
            try:
                reason = read_small(why, 64 * 1024).decode(errors="replace").strip()
            except (OSError, NotRegularFile):
                reason = "reason not recorded"
            found.append((f"{RECORDS}/{name}", reason))
    return found


def remove_partial_records(root: Path) -> None:
    """Drop ``*.tmp`` files a writer left when it died mid-write (they never counted)."""
    directory = records_dir(root)
    if not directory.is_dir():
        return
    for name in os.listdir(directory):
        if name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)


def write_pointer(root: Path, version: int) -> None:
    write_file_durably(root / POINTER, f"{version_name(version)}\n".encode())


def read_pointer(root: Path) -> int | None:
    """The version GLOBAL names, or ``None`` (it is a hint; the records are authoritative)."""
    try:  # a regular file only, read with a bound: a FIFO named GLOBAL must not hang a reader
        text = read_small(root / POINTER, 64).decode().strip()
    except (OSError, NotRegularFile, UnicodeDecodeError):
        return None
    return version_number(text)


def read_record(path: Path) -> GlobalRecord:
    """Read and validate one global record.

    Raises:
        ManifestError / CorruptCheckpoint: naming the file, what is wrong, and the fix.
    """
    fix = GLOBAL_RECORD.fix
    try:  # a regular file only (never a FIFO, device or link), read with a bound
        raw = read_small(path, MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: global record is missing") from None
    if len(raw) > MAX_RECORD_BYTES:
        raise ManifestError(f"{path}: global record is over {MAX_RECORD_BYTES} bytes; {fix}")
    _, parsed = GLOBAL_RECORD.open(raw, path)
    record = parse_record(parsed, str(path))
    match = _RECORD_NAME.match(path.name)
    if match and int(match.group(1)) != record.version:
        raise ManifestError(
            f"{path}: file name says version {int(match.group(1))}, body says "
            f"{record.version}; {fix}"
        )
    return record


def record_from_bytes(raw: bytes, where: str) -> GlobalRecord:
    """A record from its file's bytes (another rank's copy, the object store's), checked as
    :func:`read_record` checks a file (``where`` names it in errors)."""
    if len(raw) > MAX_RECORD_BYTES:
        raise ManifestError(f"{where}: global record is over {MAX_RECORD_BYTES} bytes")
    _, parsed = GLOBAL_RECORD.open(raw, where)
    return parse_record(parsed, where)


def parse_record(body: Any, where: str = "<global record>") -> GlobalRecord:
    """Validate a decoded record body (types, ranks 0..N-1 in order, safe directory names)."""

    fields = BodyFields(where)
    fail, integer = fields.fail, fields.integer
    if not isinstance(body, dict):
        raise fail("body must be a JSON object")
    version = integer(body.get("version"), "version", 1)
    step = integer(body.get("step"), "step", -(1 << 62))
    world_size = integer(body.get("world_size"), "world_size", 1, MAX_WORLD_SIZE)
    wall_time = body.get("wall_time", 0.0)
    if isinstance(wall_time, bool) or not isinstance(wall_time, int | float):
        raise fail("wall_time must be a number")
    raw_shards = body.get("shards")
    if not isinstance(raw_shards, list) or len(raw_shards) != world_size:
        raise fail(f"'shards' must list one shard per rank ({world_size})")
    shards = []
    for rank, raw in enumerate(raw_shards):
        if not isinstance(raw, dict):
            raise fail(f"shard {rank} must be an object")
        if raw.get("rank") != rank:
            raise fail(f"shard {rank} says rank {raw.get('rank')!r}; shards must be in rank order")
        if raw.get("directory") != rank_dirname(rank):
            raise fail(f"shard {rank} names directory {raw.get('directory')!r}")
        crc = raw.get("manifest_crc32c")
        if not is_crc(crc):
            raise fail(f"shard {rank} has an invalid manifest_crc32c {crc!r}")
        shard = ShardRef(
            rank=rank,
            directory=raw["directory"],
            version=integer(raw.get("version"), f"shard {rank} version", 1),
            step=integer(raw.get("step"), f"shard {rank} step", -(1 << 62)),
            manifest_crc32c=crc,
            nbytes=integer(raw.get("nbytes"), f"shard {rank} nbytes"),
        )
        # Every rank saves a global version at one step under its number: a record whose
        # shards name other versions or steps would restore a mix of two saves.
        if (shard.version, shard.step) != (version, step):
            raise fail(
                f"shard {rank} is version {shard.version} at step {shard.step}, not the "
                f"record's version {version} at step {step}"
            )
        shards.append(shard)
    return GlobalRecord(version, step, float(wall_time), world_size, tuple(shards))


def valid_records(
    root: Path, *, refuse_newer: bool = False
) -> tuple[list[GlobalRecord], list[tuple[int, str]]]:
    """Every record that validates, newest first, and (version, reason) for those that do not.

    Raises:
        UnsupportedCheckpoint: with ``refuse_newer`` (a restore), when a record newer than
            every valid one is of a newer format: restoring an older one would drop its work.
    """
    good, bad = [], []
    for version in reversed(record_versions(root)):
        try:
            good.append(read_record(record_path(root, version)))
        except UnsupportedCheckpoint as exc:
            if refuse_newer and not good:
                raise
            bad.append((version, str(exc)))
        except (ManifestError, OSError) as exc:
            bad.append((version, str(exc)))
    return good, bad


def shard_ref(root: Path, rank: int, version: int, step: int) -> ShardRef:
    """Rank ``rank``'s committed shard of ``version``, as a record names it.

    Raises:
        CorruptCheckpoint / OSError: its manifest or data files cannot be read.
    """
    directory = root / rank_dirname(rank) / version_name(version)
    return ShardRef(
        rank=rank,
        directory=rank_dirname(rank),
        version=version,
        step=step,
        manifest_crc32c=manifest_crc(directory / MANIFEST_NAME),
        nbytes=stored_data_bytes(directory),
    )


# --- publishing -------------------------------------------------------------------------------


def publish(
    root: Path,
    record: GlobalRecord,
    keep: int,
    retained: Sequence[int] | None = None,
    protect: Collection[int] = (),
) -> list[int]:
    """Commit global version ``record.version``: every shard it names is durable.

    Writes the record durably (the commit point), then the GLOBAL pointer (a hint: a
    failure is logged), then deletes the records older than it beyond the newest ``keep``
    of ``retained`` (the valid global versions the caller knows of; by default every record
    on disk) and it, and those of ``protect`` (the peer tier's: the newest version secured
    beyond every node and those it has yet to copy: a lost node's shards may be had only
    for those). The ranks' own
    retention deletes the shards no record needs at their next commit. Returns the retained
    global versions, oldest first.

    Raises:
        OSError: the record could not be written (nothing was published).
    """
    version = record.version
    write_record(root, record)
    crash_point("global_record_written")
    try:
        write_pointer(root, version)
    except OSError as exc:  # the record is the commit point; GLOBAL is only a hint
        log.warning("could not update %s: %s", root / POINTER, exc)
    crash_point("global_published")
    known = record_versions(root) if retained is None else retained
    kept = sorted({*known, version})[-keep:]
    kept = sorted({*kept, *(v for v in protect if v in known)})
    for old in record_versions(root):
        if old < version and old not in kept:
            try:
                delete_record(root, old)
            except OSError as exc:
                log.warning("could not delete global record v%d: %s", old, exc)
    return kept


# --- what a rank's retention may delete -------------------------------------------------------


def retention_allowed(doomed: list[int], retained: list[int], decided_up_to: int) -> list[int]:
    """The local versions among ``doomed`` that no global version needs, now or later
    (a :class:`~pcframe.distributed.DistributedCheckpointer`'s rank).

    A version may go once its round is decided (``<= decided_up_to``) and it is not one of the
    retained global versions (the newest ``keep_global``: the current and the previous one).
    Rounds are decided in order and global versions only move forward, so a decided version
    that is not retained can never be needed again. A rank learns of new global versions
    after rank 0 has written them, so its view only lags, and lagging keeps more, never less.
    """
    keep = set(retained)
    return [v for v in doomed if v <= decided_up_to and v not in keep]


class GlobalShards:
    """Retention reason of a rank's directory written through DCP: the shards some global
    version may still need.

    A shard is kept while a global record names its version, or while it is newer than the
    newest record (its global version is not decided yet). Records are read from disk at
    each commit, so every rank sees what the coordinator pruned.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def keep(self, committed: Sequence[int]) -> set[int]:
        records = set(record_versions(self.root))
        newest = max(records, default=0)
        return {v for v in committed if v in records or v > newest}


# --- numbering --------------------------------------------------------------------------------


def next_version(root: Path) -> int:
    """One above every version number ``root`` has used: its own versions (a root written
    by one rank), every ``rank-<r>/`` shard directory, the records and the pointer.

    A number is never reused, even for a version a crash left behind on one rank only.
    """
    used = record_versions(root)
    pointer = read_pointer(root)
    directories = [CheckpointDir(root)]
    if root.is_dir():
        directories += [CheckpointDir(root / n) for n in os.listdir(root) if RANK_DIR.match(n)]
    for directory in directories:
        used += directory.taken_versions()  # a stray file named v00000003 takes 3 too
        used.append(directory.latest_hint() or 0)
    return max([pointer or 0, *used], default=0) + 1
