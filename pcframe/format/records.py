"""The records of one checkpoint version's manifest, and how they are written.

:class:`Manifest` holds what one version is (its tensors, where their bytes are, the chunk
checksums, the state tree); :meth:`Manifest.to_bytes` gives the file. The file form, the
format versions and the reading side (integrity check, hard limits, validation) are in
:mod:`pcframe.format.manifest`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import crc32c

from pcframe.errors import ManifestError
from pcframe.format.layout import Entry, Layout

FORMAT = "pcframe-manifest"
FORMAT_VERSION = 4  # the newest this code reads and writes
STRIPED_FORMAT_VERSION = 4  # written when data.bin is striped over several files
NUMPY_FORMAT_VERSION = 3  # written when the state tree holds a numpy scalar
CODED_FORMAT_VERSION = 2  # written when a tensor is coded (codec.bin, deltas)
PLAIN_FORMAT_VERSION = 1  # written when no tensor is coded: readable by every pcframe
# Version 3 adds numpy scalars to the state tree ({"$np": [dtype, text]}), version 4 the
# stripes of data.bin (files/data.bin/stripes): each written only when used, so that a
# pcframe before it says "upgrade" instead of "corrupt".
MANIFEST_NAME = "manifest.json"
DATA_NAME = "data.bin"
CODEC_NAME = "codec.bin"


@dataclass
class ChunkRecord:
    offset: int
    length: int
    checksum: str


@dataclass(frozen=True)
class SegmentRecord:
    """One encoded segment of a coded tensor: where its payload is and what it holds."""

    offset: int  # byte offset of the payload in codec.bin
    length: int  # payload bytes
    checksum: str  # of the payload, with the manifest's algorithm
    start: int  # first element of the tensor (row-major) it holds
    count: int  # elements it holds
    meta: dict[str, Any]  # the codec's JSON meta (scales offset, error bound, ...)

    def to_list(self) -> list[Any]:
        return [self.offset, self.length, self.checksum, self.start, self.count, self.meta]


@dataclass(frozen=True)
class DeltaLink:
    """A delta version's base: the committed version its delta tensors are XORed against."""

    base: int
    depth: int  # versions read to restore it, minus one (the full version has depth 0)


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
    segments: dict[int, list[SegmentRecord]] = field(default_factory=dict)  # coded entries
    codec_size: int = 0  # bytes of codec.bin
    delta: DeltaLink | None = None
    stripes: int = 1  # files data.bin's chunks are spread over (pcframe.format.stripes)

    @property
    def coded(self) -> bool:
        """Whether any tensor is stored with a codec (format version 2)."""
        return bool(self.segments) or any(not e.raw for e in self.entries) or bool(self.delta)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the version's data files: ``data.bin`` and, if coded, ``codec.bin``."""
        return self.data_size + self.codec_size

    @property
    def format_version(self) -> int:
        if self.stripes > 1:
            return STRIPED_FORMAT_VERSION
        if _holds_numpy_scalar(self.tree):
            return NUMPY_FORMAT_VERSION
        return CODED_FORMAT_VERSION if self.coded else PLAIN_FORMAT_VERSION

    @property
    def depth(self) -> int:
        return self.delta.depth if self.delta is not None else 0

    @property
    def raw_layout(self) -> Layout:
        """The data.bin layout; coded entries are not in its chunks."""
        return Layout.from_entries(self.entries, self.data_size, self.chunk_bytes)

    @property
    def layout(self) -> Layout:
        """The data.bin layout of a version whose tensors are all raw.

        Raises:
            ManifestError: some tensors are coded; a reader of ``data.bin`` alone would miss
                them (read such versions with :func:`pcframe.restore.reader.load_version`).
        """
        if self.coded:
            coded = [e.name for e in self.entries if not e.raw][:3]
            raise ManifestError(
                f"version {self.version} stores tensors with codecs (e.g. {coded}); this "
                "reader reads raw tensors only: load it with pcframe.restore.reader.load_version"
            )
        return self.raw_layout

    def error_bound(self, name: str) -> float:
        """Largest absolute error a lossy codec recorded for tensor ``name`` (0.0 if exact)."""
        for index, entry in enumerate(self.entries):
            if entry.name == name:
                bounds = [s.meta.get("error_bound", 0.0) for s in self.segments.get(index, [])]
                return float(max(bounds, default=0.0))
        raise KeyError(f"version {self.version} has no tensor named {name!r}")

    def body(self) -> dict[str, Any]:
        files: dict[str, Any] = {
            DATA_NAME: {
                "size": self.data_size,
                "chunks": [[c.offset, c.length, c.checksum] for c in self.chunks],
            }
        }
        if self.stripes > 1:
            files[DATA_NAME]["stripes"] = self.stripes
        if self.coded:
            files[CODEC_NAME] = {"size": self.codec_size}
        body = {
            "version": self.version,
            "step": self.step,
            "wall_time": self.wall_time,
            "checksum": self.checksum,
            "chunk_bytes": self.chunk_bytes,
            "files": files,
            "tensors": [self._tensor(i, e) for i, e in enumerate(self.entries)],
            "numpy_tensors": self.numpy_tensors,
            "tree": self.tree,
            "codecs": self.codecs,
            "metadata": self.metadata,
            "engine": self.engine,
        }
        if self.delta is not None:
            body["delta"] = {"base": self.delta.base, "depth": self.delta.depth}
        return body

    def _tensor(self, index: int, e: Entry) -> dict[str, Any]:
        item: dict[str, Any] = {"name": e.name, "dtype": e.dtype, "shape": list(e.shape)}
        if e.raw:
            item.update(file=DATA_NAME, offset=e.offset, nbytes=e.nbytes, codec="raw")
        else:
            segments = [s.to_list() for s in self.segments.get(index, [])]
            item.update(file=CODEC_NAME, nbytes=e.nbytes, codec=e.codec, segments=segments)
        return item

    def to_bytes(self) -> bytes:
        body = json.dumps(self.body(), separators=(",", ":")).encode()
        header = {
            "format": FORMAT,
            "format_version": self.format_version,
            "body_bytes": len(body),
            "body_crc32c": f"{crc32c.crc32c(body):08x}",
        }
        return json.dumps(header).encode() + b"\n" + body


def _holds_numpy_scalar(node: Any) -> bool:
    """Whether an encoded state tree has a ``$np`` node (format version 3)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            if "$np" in current and len(current) == 1:
                return True
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)
    return False
