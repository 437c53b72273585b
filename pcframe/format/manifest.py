"""The JSON manifest of one checkpoint version: written last, verified first.

File form (``manifest.json``): the JSON body under the one-line integrity header of
:mod:`pcframe.format.envelope` (format ``pcframe-manifest``), checked before the body is
parsed. The body is validated against hard limits before anything is allocated from it.

Format versions: 1 has every tensor raw in ``data.bin``. 2 (written only when codecs are
configured, so default checkpoints stay readable by older pcframe) adds ``codec.bin``: a
coded tensor has ``file: "codec.bin"``, its codec name and ``segments``
``[[offset, length, checksum, start, count, meta], ...]`` covering its elements in order,
and the segments of all tensors tile ``codec.bin`` exactly. A delta version also has
``delta: {"base": b, "depth": d}``: its ``xor_delta_zstd`` tensors are XORed against the
same tensors of committed version ``b``, whose own depth is ``d - 1`` (a full version has
no ``delta`` and depth 0). A reader of version 1 rejects version 2 by the header.
Version 3 allows numpy scalars in the state tree. Version 4 allows
``files/data.bin/stripes: K``: the chunks are spread over ``K`` files
(:mod:`pcframe.format.stripes`); the layout and checksums are those of one ``data.bin``.
Version 5 allows the tagged standard subtypes in the state tree (``Counter``,
``OrderedDict``, ``defaultdict``, namedtuples, enum members: :mod:`pcframe.format.tree`).

:class:`Manifest` holds what one version is (its tensors, where their bytes are, the chunk
checksums, the state tree); :meth:`Manifest.to_bytes` gives the file, :func:`read_manifest`
reads and validates one (a coded tensor's segments in :mod:`pcframe.format.segments`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from pcframe.errors import CorruptCheckpoint, ManifestError
from pcframe.format.checksum import CHECKSUMS
from pcframe.format.envelope import BodyFields, Envelope, header_crc, seal
from pcframe.format.files import open_regular, read_small
from pcframe.format.layout import Entry, Layout
from pcframe.format.names import CODEC_NAME, DATA_NAME, MANIFEST_NAME, MAX_VERSION, SAFE_FILE
from pcframe.format.segments import CodedSegments, SegmentRecord
from pcframe.format.stripes import MAX_STRIPES
from pcframe.format.tree import TYPED_TAGS, check_tree, tags_held
from pcframe.kernels.dtypes import DTYPES

FORMAT = "pcframe-manifest"
FORMAT_VERSION = 5  # the newest this code reads and writes
TYPED_FORMAT_VERSION = 5  # written when the state tree holds a Counter, namedtuple, enum...
STRIPED_FORMAT_VERSION = 4  # written when data.bin is striped over several files
NUMPY_FORMAT_VERSION = 3  # written when the state tree holds a numpy scalar
CODED_FORMAT_VERSION = 2  # written when a tensor is coded (codec.bin, deltas)
PLAIN_FORMAT_VERSION = 1  # written when no tensor is coded: readable by every pcframe
# The tree's section in a version that torch DCP wrote through pcframe's StorageWriter
# (pcframe.integrations.dcp): DCP's items, none of a Checkpointer's sections.
DCP_SECTION = "dcp"
# Version 3 adds numpy scalars to the state tree ({"$np": [dtype, text]}), version 4 the
# stripes of data.bin (files/data.bin/stripes), version 5 the tree's standard subtypes
# ({"$counter": ...}, {"$enum": ...}: TYPED_TAGS): each written only when used, so that a
# pcframe before it says "upgrade" instead of "corrupt".


@dataclass
class ChunkRecord:
    offset: int
    length: int
    checksum: str


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
        tags = tags_held(self.tree)
        if tags & TYPED_TAGS:
            return TYPED_FORMAT_VERSION
        if self.stripes > 1:
            return STRIPED_FORMAT_VERSION
        if "$np" in tags:
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
        """The file form: the body under its integrity header (:mod:`pcframe.format.envelope`)."""
        return seal(FORMAT, self.format_version, self.body())


__all__ = ["CODEC_NAME", "DATA_NAME", "MANIFEST_NAME", "Manifest", "SegmentRecord", "read_manifest"]

READABLE_VERSIONS = (1, 2, 3, 4, 5)
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_TENSORS = 1_000_000
MAX_DIMS = 32
MAX_NAME = 4096  # characters in a tensor's name (its path in the state tree)
MAX_CHUNK_BYTES = 1 << 30
MAX_CHAIN = 100  # deepest delta chain a reader follows (EngineConfig.full_every <= 100)
MAX_STEP = 1 << 62  # |step| at most this


def is_valid_step(step: object) -> bool:
    """Whether a reader takes ``step`` (an integer within ±:data:`MAX_STEP`): a writer that
    stored another would commit a version every restore then refuses."""
    return isinstance(step, int) and not isinstance(step, bool) and abs(step) <= MAX_STEP


MAX_WALL_TIME = 253402300799.0  # 9999-12-31 23:59:59 UTC: what time.strftime can show
# Elements of one tensor, counting zero-sized dimensions as 1 (torch.empty([0, 10**30])
# overflows; a non-empty tensor is bounded by its nbytes anyway).
MAX_NUMEL = 1 << 56
# Tensors that decode back to numpy arrays ('numpy_tensors'): dtypes numpy can hold.
_NUMPY_DTYPES = frozenset(DTYPES) - {"bfloat16", "float8_e4m3fn", "float8_e5m2"}


def read_manifest(path: str) -> Manifest:
    """Read, integrity-check and validate a manifest file. Never unpickles, never trusts sizes.

    Raises:
        ManifestError / CorruptCheckpoint: with the file and the reason.
    """
    try:  # a regular file only: a FIFO or device named manifest.json is refused unread
        fd = open_regular(path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: manifest is missing") from None
    except IsADirectoryError:
        raise CorruptCheckpoint(f"{path}: manifest is a directory") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{path}: manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} limit"
            )
        raw = f.read(size + 1)  # its own size: a buffer of the limit is 256 MiB up front
    return manifest_from_bytes(raw, path)


def manifest_from_bytes(raw: bytes, path: str) -> Manifest:
    """Integrity-check and validate a manifest's bytes (read from a file, or received from
    another rank before anything is written); ``path`` names it in errors.

    Raises:
        ManifestError / CorruptCheckpoint: with ``path`` and the reason.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{path}: manifest is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES} limit"
        )
    format_version, parsed = Envelope(FORMAT, READABLE_VERSIONS, "manifest").open(raw, path)
    return parse_body(parsed, path, format_version)


MANIFEST_HEAD = 4096  # bytes at the start of a manifest that hold its header line


def manifest_crc(manifest_path: str | os.PathLike[str]) -> str:
    """The body checksum from a manifest's header line (what a global record pins a shard
    by, and a peer copy or a replica tier's copy is matched against).

    Raises:
        CorruptCheckpoint / OSError: no header with a valid checksum, or unreadable.
    """
    return head_crc(read_small(manifest_path, MANIFEST_HEAD), manifest_path)


def head_crc(head: bytes, path: object) -> str:
    """The body checksum from a manifest's first :data:`MANIFEST_HEAD` bytes (read from a
    file, or from an object store); ``path`` names it in errors.

    Raises:
        CorruptCheckpoint: no header with a valid checksum.
    """
    return header_crc(head.partition(b"\n")[0], path)


def delta_base(directory: str | os.PathLike[str]) -> int:
    """The version a version directory's delta reads (0 for a full version).

    Raises:
        ManifestError / CorruptCheckpoint / OSError: as :func:`read_manifest`.
    """
    manifest = read_manifest(os.path.join(directory, MANIFEST_NAME))
    return manifest.delta.base if manifest.delta is not None else 0


def parse_body(body: Any, path: str = "<manifest>", format_version: int = 1) -> Manifest:
    """Validate a decoded manifest body against hard limits and return a :class:`Manifest`.

    ``format_version`` comes from the header: version 1 bodies may not use codecs.
    """

    fields = BodyFields(path)
    fail, integer = fields.fail, fields.integer
    if not isinstance(body, dict):
        raise fail("body must be a JSON object")
    version = integer(body.get("version"), "version", 0, MAX_VERSION)
    step = integer(body.get("step"), "step", -MAX_STEP, MAX_STEP)
    wall_time = body.get("wall_time", 0.0)
    if (
        isinstance(wall_time, bool)
        or not isinstance(wall_time, int | float)
        or not 0 <= wall_time <= MAX_WALL_TIME  # False for NaN too
    ):
        raise fail(
            f"wall_time must be seconds since 1970 in [0, {MAX_WALL_TIME:.0f}], "
            f"got {wall_time!r:.40}"
        )
    checksum = body.get("checksum")
    if not isinstance(checksum, str) or checksum not in CHECKSUMS:
        raise fail(f"unknown checksum algorithm {checksum!r:.40}; known: {', '.join(CHECKSUMS)}")
    chunk_bytes = integer(body.get("chunk_bytes"), "chunk_bytes", 1, MAX_CHUNK_BYTES)

    files = body.get("files")
    allowed = [{DATA_NAME}] + ([{DATA_NAME, CODEC_NAME}] if format_version >= 2 else [])
    if not isinstance(files, dict) or set(files) not in allowed:
        also = f" (and {CODEC_NAME!r} from format version 2)" if format_version < 2 else ""
        got = sorted(files) if isinstance(files, dict) else files
        raise fail(f"'files' must list {DATA_NAME!r}{also}, got {got!r:.200}")
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
    stripes = 1
    if "stripes" in data:
        if format_version < 4:
            raise fail(f"files/{DATA_NAME}/stripes needs format version 4")
        most = max(1, min(MAX_STRIPES, expected_chunks))
        stripes = integer(data["stripes"], f"files/{DATA_NAME}/stripes", 1, most)
    codec_size = 0
    if CODEC_NAME in files:
        if not isinstance(files[CODEC_NAME], dict):
            raise fail(f"files/{CODEC_NAME} must be an object")
        codec_size = integer(files[CODEC_NAME].get("size"), f"files/{CODEC_NAME}/size")

    raw_tensors = body.get("tensors")
    if not isinstance(raw_tensors, list):
        raise fail("'tensors' must be a list")
    if len(raw_tensors) > MAX_TENSORS:
        raise fail(f"{len(raw_tensors)} tensors is over the limit of {MAX_TENSORS}")
    coded = CodedSegments(fail, integer, chunk_bytes, codec_size, format_version)
    entries = [_parse_entry(t, i, data_size, fail, coded) for i, t in enumerate(raw_tensors)]
    _check_unique_names(entries, fail)
    _check_no_overlap([e for e in entries if e.raw], fail)
    coded.check_tiling()
    delta = _parse_delta(body.get("delta"), version, integer, fail)
    if coded.needs_base and delta is None:
        raise fail("a tensor uses a delta codec but the manifest names no 'delta' base version")
    if delta is not None and format_version < 2:
        raise fail("'delta' needs manifest format version 2")

    numpy_tensors = _parse_numpy_tensors(body.get("numpy_tensors", []), entries, fail)
    for key in ("codecs", "metadata", "engine"):
        if not isinstance(body.get(key, {}), dict):
            raise fail(f"'{key}' must be an object")
    try:  # every tag and tensor reference, so a restore never fails after choosing a version
        check_tree(body.get("tree"), len(entries), numpy_tensors)
    except ManifestError as exc:
        raise fail(str(exc)) from None
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
        segments=coded.segments,
        codec_size=codec_size,
        delta=delta,
        stripes=stripes,
    )


def _parse_entry(raw: Any, i: int, data_size: int, fail: Any, coded: CodedSegments) -> Entry:
    if not isinstance(raw, dict):
        raise fail(f"tensor {i} must be an object")
    name = raw.get("name")
    if not isinstance(name, str) or len(name) > MAX_NAME:
        raise fail(f"tensor {i} has no valid name")
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise fail(f"tensor {name!r} has unknown dtype {dtype!r:.40}; known: {', '.join(DTYPES)}")
    codec = raw.get("codec", "raw")
    if not isinstance(codec, str):
        raise fail(f"tensor {name!r} has a codec {codec!r:.40} that is not a name")
    if codec != "raw":
        coded.check_codec(name, codec)
    expected_file = DATA_NAME if codec == "raw" else CODEC_NAME
    if raw.get("file") != expected_file or not SAFE_FILE.match(str(raw.get("file"))):
        raise fail(
            f"tensor {name!r} refers to file {raw.get('file')!r}, expected {expected_file!r}"
        )
    shape = raw.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise fail(f"tensor {name!r} has an invalid shape {shape!r:.200}")
    offset = raw.get("offset") if codec == "raw" else 0  # coded tensors live in segments
    nbytes = raw.get("nbytes")
    for value, what in ((offset, "offset"), (nbytes, "nbytes")):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 62:
            raise fail(f"tensor {name!r} has an invalid {what} {value!r:.40}")
    itemsize = DTYPES[dtype].itemsize
    if math.prod(shape) * itemsize != nbytes:
        raise fail(f"tensor {name!r}: shape {shape} x {itemsize} bytes != nbytes {nbytes}")
    if math.prod(max(d, 1) for d in shape) > MAX_NUMEL:  # e.g. [0, 10**30]: empty, unbuildable
        raise fail(f"tensor {name!r} has a shape {shape!r:.200} over {MAX_NUMEL} elements")
    if codec != "raw":
        coded.parse(i, name, codec, math.prod(shape), dtype, raw.get("segments"))
        return Entry(name, dtype, tuple(shape), 0, nbytes, codec)
    if offset + nbytes > data_size:
        raise fail(f"tensor {name!r} ends at byte {offset + nbytes}, past the data ({data_size})")
    return Entry(name, dtype, tuple(shape), offset, nbytes)


def _parse_delta(raw: Any, version: int, integer: Any, fail: Any) -> DeltaLink | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail("'delta' must be an object {base, depth} or absent")
    base = integer(raw.get("base"), "delta base", 1, max(1, version - 1))
    if base >= version:
        raise fail(f"delta base {base} must be older than version {version}")
    depth = integer(raw.get("depth"), "delta depth", 1, MAX_CHAIN)
    return DeltaLink(base, depth)


def _check_unique_names(entries: list[Entry], fail: Any) -> None:
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise fail(f"tensor name {entry.name!r} appears more than once in 'tensors'")
        seen.add(entry.name)


def _parse_numpy_tensors(raw: Any, entries: list[Entry], fail: Any) -> list[int]:
    if not isinstance(raw, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(entries) for i in raw
    ):
        raise fail(f"'numpy_tensors' must list tensor indices in [0, {len(entries)})")
    if len(set(raw)) != len(raw):
        raise fail("'numpy_tensors' lists a tensor more than once")
    for i in raw:
        if entries[i].dtype not in _NUMPY_DTYPES:
            raise fail(
                f"'numpy_tensors' lists tensor {entries[i].name!r} of dtype {entries[i].dtype}, "
                "which numpy cannot hold"
            )
    return raw


def _check_no_overlap(entries: list[Entry], fail: Any) -> None:
    end = 0
    for entry in sorted((e for e in entries if e.nbytes), key=lambda e: e.offset):
        if entry.offset < end:
            raise fail(f"tensor {entry.name!r} overlaps the previous tensor")
        end = entry.offset + entry.nbytes
