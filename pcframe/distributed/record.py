"""The global record: which shard of every rank makes up one global checkpoint version.

Layout of a distributed checkpoint root::

    root/
      GLOBAL                 newest published global version, e.g. "v00000012" (a hint)
      global/v00000012.json  the global record of version 12: its commit point
      rank-0/                rank 0's local pcframe directory (v00000012/, LATEST, ...)
      rank-1/

Rank 0 writes ``global/vNNNNNNNN.json`` only after every rank reported its shard of that
version durably committed, so the record's existence means the whole version is on disk.
The file is written durably (tmp, fsync, rename, fsync the directory) and has the same
one-line integrity header as a manifest, followed by the JSON body::

    {"version": 12, "step": 120, "wall_time": ..., "world_size": 2,
     "shards": [{"rank": 0, "directory": "rank-0", "version": 12, "step": 120,
                 "manifest_crc32c": "1a2b3c4d", "nbytes": 123}, ...]}

``manifest_crc32c`` is the body checksum from the shard's manifest header: a restore refuses
a shard directory that was replaced by a different one of the same version number.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import crc32c

from pcframe.errors import CorruptCheckpoint, ManifestError, UnsupportedCheckpoint
from pcframe.format.files import NotRegularFile, read_small
from pcframe.format.names import version_from_digits, version_name, version_number
from pcframe.store.directory import QUARANTINE_PREFIX, fsync_dir, write_file_durably

FORMAT = "pcframe-global"
FORMAT_VERSION = 1
POINTER = "GLOBAL"
RECORDS = "global"
MAX_RECORD_BYTES = 16 * 1024 * 1024
MAX_WORLD_SIZE = 1 << 20
_RECORD_NAME = re.compile(r"^v(\d{8,})\.json$")
_CRC = re.compile(r"^[0-9a-f]{8}$")


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
        raw = json.dumps(body, separators=(",", ":")).encode()
        header = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "body_bytes": len(raw),
            "body_crc32c": f"{crc32c.crc32c(raw):08x}",
        }
        return json.dumps(header).encode() + b"\n" + raw


def record_path(root: Path, version: int) -> Path:
    return root / RECORDS / f"{version_name(version)}.json"


def record_versions(root: Path) -> list[int]:
    """Versions that have a global record file, oldest first (validity not checked)."""
    try:
        names = os.listdir(root / RECORDS)
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
    directory = root / RECORDS
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(root)
    write_file_durably(record_path(root, record.version), record.to_bytes())


def delete_record(root: Path, version: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record_path(root, version))
        fsync_dir(root / RECORDS)


def quarantine_record(root: Path, version: int) -> None:
    """Move the record of a global version that failed verification out of the listing.

    It is kept as ``global/.corrupt-vNNNNNNNN-<pid>.json``, so the version no longer counts
    as one of the ``keep_global`` retained versions, and ``pcframe list`` does not show it.
    On read-only media it stays listed and is skipped again by the next restore.
    """
    target = root / RECORDS / f"{QUARANTINE_PREFIX}{version_name(version)}-{os.getpid()}.json"
    with contextlib.suppress(OSError):
        os.rename(record_path(root, version), target)
        fsync_dir(root / RECORDS)


def remove_partial_records(root: Path) -> None:
    """Drop ``*.tmp`` files a writer left when it died mid-write (they never counted)."""
    directory = root / RECORDS
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
    fix = "delete this file to fall back to the previous global version"
    try:  # a regular file only (never a FIFO, device or link), read with a bound
        raw = read_small(path, MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: global record is missing") from None
    if len(raw) > MAX_RECORD_BYTES:
        raise ManifestError(f"{path}: global record is over {MAX_RECORD_BYTES} bytes; {fix}")
    line, sep, body = raw.partition(b"\n")
    try:
        header = json.loads(line) if sep else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{path}: not a pcframe global record (truncated?); {fix}")
    written = header.get("format_version")
    if written != FORMAT_VERSION:
        newer = type(written) is int and written > FORMAT_VERSION  # a newer writer, not damage
        raise (UnsupportedCheckpoint if newer else ManifestError)(
            f"{path}: global record format_version {written!r} is not "
            f"supported (this pcframe reads {FORMAT_VERSION}); upgrade pcframe to read it"
        )
    if header.get("body_bytes") != len(body) or header.get("body_crc32c") != (
        f"{crc32c.crc32c(body):08x}"
    ):
        raise CorruptCheckpoint(f"{path}: global record checksum mismatch; {fix}")
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{path}: global record body is not JSON ({exc}); {fix}") from None
    record = parse_record(parsed, str(path))
    match = _RECORD_NAME.match(path.name)
    if match and int(match.group(1)) != record.version:
        raise ManifestError(
            f"{path}: file name says version {int(match.group(1))}, body says "
            f"{record.version}; {fix}"
        )
    return record


def parse_record(body: Any, where: str = "<global record>") -> GlobalRecord:
    """Validate a decoded record body (types, ranks 0..N-1 in order, safe directory names)."""

    def fail(reason: str) -> ManifestError:
        return ManifestError(f"{where}: {reason}")

    def integer(value: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise fail(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
        return value

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
        if not isinstance(crc, str) or not _CRC.match(crc):
            raise fail(f"shard {rank} has an invalid manifest_crc32c {crc!r}")
        shards.append(
            ShardRef(
                rank=rank,
                directory=raw["directory"],
                version=integer(raw.get("version"), f"shard {rank} version", 1),
                step=integer(raw.get("step"), f"shard {rank} step", -(1 << 62)),
                manifest_crc32c=crc,
                nbytes=integer(raw.get("nbytes"), f"shard {rank} nbytes"),
            )
        )
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


def manifest_crc(manifest_path: Path) -> str:
    """The body checksum from a shard manifest's header line (what the record pins)."""
    line = read_small(manifest_path, 4096).partition(b"\n")[0]
    try:
        crc = json.loads(line)["body_crc32c"]
    except (ValueError, KeyError, TypeError):
        raise CorruptCheckpoint(f"{manifest_path}: manifest header is unreadable") from None
    if not isinstance(crc, str) or not _CRC.match(crc):
        raise CorruptCheckpoint(f"{manifest_path}: manifest header has no valid body_crc32c")
    return crc
