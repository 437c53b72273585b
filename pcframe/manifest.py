"""The JSON manifest of one checkpoint version: written last, verified first.

File form (``manifest.json``)::

    {"format": "pcframe-manifest", "format_version": 1, "body_bytes": N, "body_crc32c": "..."}\n
    <N bytes of JSON body>

The one-line header lets a reader check the body's integrity before parsing it, so a flipped
byte anywhere in the manifest is detected rather than silently changing a number. The body
is validated against hard limits before anything is allocated from it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import crc32c

from pcframe.errors import CorruptCheckpoint, ManifestError
from pcframe.layout import Entry, Layout
from pcframe.state import DTYPES

FORMAT = "pcframe-manifest"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DATA_NAME = "data.bin"

MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_TENSORS = 1_000_000
MAX_DIMS = 32
MAX_CHUNK_BYTES = 1 << 30
_SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


@dataclass
class ChunkRecord:
    offset: int
    length: int
    checksum: str


@dataclass
class Manifest:
    version: int
    step: int
    wall_time: float
    checksum: str
    chunk_bytes: int
    data_size: int
    entries: list[Entry]
    chunks: list[ChunkRecord]
    tree: Any
    numpy_tensors: list[int] = field(default_factory=list)
    codecs: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def layout(self) -> Layout:
        return Layout.from_entries(self.entries, self.data_size, self.chunk_bytes)

    def body(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "step": self.step,
            "wall_time": self.wall_time,
            "checksum": self.checksum,
            "chunk_bytes": self.chunk_bytes,
            "files": {
                DATA_NAME: {
                    "size": self.data_size,
                    "chunks": [[c.offset, c.length, c.checksum] for c in self.chunks],
                }
            },
            "tensors": [
                {
                    "name": e.name,
                    "dtype": e.dtype,
                    "shape": list(e.shape),
                    "file": DATA_NAME,
                    "offset": e.offset,
                    "nbytes": e.nbytes,
                    "codec": "raw",
                }
                for e in self.entries
            ],
            "numpy_tensors": self.numpy_tensors,
            "tree": self.tree,
            "codecs": self.codecs,
            "metadata": self.metadata,
            "engine": self.engine,
        }

    def to_bytes(self) -> bytes:
        body = json.dumps(self.body(), separators=(",", ":")).encode()
        header = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "body_bytes": len(body),
            "body_crc32c": f"{crc32c.crc32c(body):08x}",
        }
        return json.dumps(header).encode() + b"\n" + body


def read_manifest(path: str) -> Manifest:
    """Read, integrity-check and validate a manifest file. Never unpickles, never trusts sizes.

    Raises:
        ManifestError / CorruptCheckpoint: with the file and the reason.
    """
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: manifest is missing") from None
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{path}: manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} limit"
        )
    with open(path, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    line, sep, body = raw.partition(b"\n")
    if not sep:
        raise CorruptCheckpoint(f"{path}: manifest has no header line (truncated?)")
    try:
        header = json.loads(line)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{path}: manifest header is not JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ManifestError(f"{path}: not a pcframe manifest (header {line[:80]!r})")
    if header.get("format_version") != FORMAT_VERSION:
        raise ManifestError(
            f"{path}: manifest format_version {header.get('format_version')!r} is not supported "
            f"by this pcframe (reads version {FORMAT_VERSION}); upgrade pcframe to read it"
        )
    if header.get("body_bytes") != len(body):
        raise CorruptCheckpoint(
            f"{path}: manifest body is {len(body)} bytes, header says {header.get('body_bytes')!r}"
        )
    if header.get("body_crc32c") != f"{crc32c.crc32c(body):08x}":
        raise CorruptCheckpoint(f"{path}: manifest checksum mismatch (bytes were altered)")
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{path}: manifest body is not valid JSON ({exc})") from None
    return parse_body(parsed, path)


def parse_body(body: Any, path: str = "<manifest>") -> Manifest:
    """Validate a decoded manifest body against hard limits and return a :class:`Manifest`."""

    def fail(reason: str) -> ManifestError:
        return ManifestError(f"{path}: {reason}")

    def integer(value: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise fail(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
        return value

    if not isinstance(body, dict):
        raise fail("body must be a JSON object")
    version = integer(body.get("version"), "version")
    step = integer(body.get("step"), "step", lo=-(1 << 62))
    wall_time = body.get("wall_time", 0.0)
    if not isinstance(wall_time, int | float) or not math.isfinite(wall_time):
        raise fail("wall_time must be a finite number")
    checksum = body.get("checksum")
    if checksum not in ("crc32c", "xxh3_64", "none"):
        raise fail(f"unknown checksum algorithm {checksum!r}")
    chunk_bytes = integer(body.get("chunk_bytes"), "chunk_bytes", 1, MAX_CHUNK_BYTES)

    files = body.get("files")
    if not isinstance(files, dict) or set(files) != {DATA_NAME}:
        raise fail(f"'files' must list exactly {DATA_NAME!r}")
    data = files[DATA_NAME]
    if not isinstance(data, dict):
        raise fail(f"files/{DATA_NAME} must be an object")
    data_size = integer(data.get("size"), f"files/{DATA_NAME}/size")
    raw_chunks = data.get("chunks")
    expected_chunks = -(-data_size // chunk_bytes)
    if not isinstance(raw_chunks, list) or len(raw_chunks) != expected_chunks:
        raise fail(f"files/{DATA_NAME}/chunks must list {expected_chunks} chunks")
    chunks, cursor = [], 0
    for i, item in enumerate(raw_chunks):
        if not isinstance(item, list) or len(item) != 3 or not isinstance(item[2], str):
            raise fail(f"chunk {i} must be [offset, length, checksum]")
        offset = integer(item[0], f"chunk {i} offset")
        length = integer(item[1], f"chunk {i} length", 1, chunk_bytes)
        if offset != cursor or (length != chunk_bytes and i != len(raw_chunks) - 1):
            raise fail(f"chunk {i} does not continue the file at byte {cursor}")
        cursor += length
        chunks.append(ChunkRecord(offset, length, item[2]))
    if cursor != data_size:
        raise fail(f"chunks cover {cursor} bytes but the data file holds {data_size}")

    raw_tensors = body.get("tensors")
    if not isinstance(raw_tensors, list):
        raise fail("'tensors' must be a list")
    if len(raw_tensors) > MAX_TENSORS:
        raise fail(f"{len(raw_tensors)} tensors is over the limit of {MAX_TENSORS}")
    entries = [_parse_entry(t, i, data_size, fail) for i, t in enumerate(raw_tensors)]
    _check_no_overlap(entries, fail)

    numpy_tensors = body.get("numpy_tensors", [])
    if not isinstance(numpy_tensors, list) or not all(
        isinstance(i, int) and 0 <= i < len(entries) for i in numpy_tensors
    ):
        raise fail("'numpy_tensors' must list tensor indices")
    for key in ("codecs", "metadata", "engine"):
        if not isinstance(body.get(key, {}), dict):
            raise fail(f"'{key}' must be an object")
    return Manifest(
        version=version,
        step=step,
        wall_time=float(wall_time),
        checksum=checksum,
        chunk_bytes=chunk_bytes,
        data_size=data_size,
        entries=entries,
        chunks=chunks,
        tree=body.get("tree"),
        numpy_tensors=numpy_tensors,
        codecs=body.get("codecs", {}),
        metadata=body.get("metadata", {}),
        engine=body.get("engine", {}),
    )


def _parse_entry(raw: Any, i: int, data_size: int, fail: Any) -> Entry:
    if not isinstance(raw, dict):
        raise fail(f"tensor {i} must be an object")
    name = raw.get("name")
    if not isinstance(name, str) or len(name) > 4096:
        raise fail(f"tensor {i} has no valid name")
    dtype = raw.get("dtype")
    if dtype not in DTYPES:
        raise fail(f"tensor {name!r} has unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if raw.get("file") != DATA_NAME or not _SAFE_FILE.match(str(raw.get("file"))):
        raise fail(f"tensor {name!r} refers to file {raw.get('file')!r}, expected {DATA_NAME!r}")
    if raw.get("codec", "raw") != "raw":
        raise fail(f"tensor {name!r} uses codec {raw.get('codec')!r}, unknown to this reader")
    shape = raw.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise fail(f"tensor {name!r} has an invalid shape {shape!r}")
    offset, nbytes = raw.get("offset"), raw.get("nbytes")
    for value, what in ((offset, "offset"), (nbytes, "nbytes")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise fail(f"tensor {name!r} has an invalid {what} {value!r}")
    itemsize = DTYPES[dtype].itemsize
    if math.prod(shape) * itemsize != nbytes:
        raise fail(f"tensor {name!r}: shape {shape} x {itemsize} bytes != nbytes {nbytes}")
    if offset + nbytes > data_size:
        raise fail(f"tensor {name!r} ends at byte {offset + nbytes}, past the data ({data_size})")
    return Entry(name, dtype, tuple(shape), offset, nbytes)


def _check_no_overlap(entries: list[Entry], fail: Any) -> None:
    end = 0
    for entry in sorted((e for e in entries if e.nbytes), key=lambda e: e.offset):
        if entry.offset < end:
            raise fail(f"tensor {entry.name!r} overlaps the previous tensor")
        end = entry.offset + entry.nbytes
