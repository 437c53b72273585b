"""What DCP writes, as pcframe's JSON state tree: the ``dcp`` section of a version's manifest.

Every rank's version holds the items that rank wrote, in the manifest's pickle-free tree::

    {"dcp": {"schema": 1, "rank": 0, "world_size": 2, "checkpoint_id": "...", "save_id": "...",
             "planner_data": {"model.w": ["model", "w"], ...} | null,
             "items": [
               {"fqn": "model.w", "kind": "tensor", "data": {"$t": 0}, "offsets": [0, 0],
                "size": [8, 4], "dtype": "float32", "requires_grad": false, "pin_memory": false},
               {"fqn": "optim.param_groups", "kind": "value", "value": <encoded tree>},
               {"fqn": "extra.obj", "kind": "pickled", "data": {"$t": 1}}]}}

``tensor`` items are one stored chunk of a (possibly sharded) tensor of global ``size``;
``value`` items are DCP's non-tensor (``BytesIO``) items whose Python value pcframe's tree
encoding holds exactly (:mod:`pcframe.format.tree`), so no pickle is stored for them;
``pickled`` items are the bytes DCP's planner produced with ``torch.save`` for values it
cannot hold, kept as a uint8 tensor (checksummed like the rest) and never unpickled by
pcframe. :func:`build_metadata` turns the items of every rank back into DCP's ``Metadata``.

Reading trusts nothing in a section: :func:`section` checks every field of it and of every
item before anything uses one (a problem is one :class:`~pcframe.errors.ManifestError` line
naming the manifest and the field, e.g. ``dcp.items[3].offsets``, so that the reader can go
back to the previous version), and :func:`build_metadata` checks that the chunks of each
tensor are disjoint boxes inside it that cover it exactly (:func:`~pcframe.distributed.
placement.cover_problem`, which the multi-rank restore checks too). A
``schema`` above :data:`SCHEMA` is a newer pcframe's: :class:`~pcframe.errors.
UnsupportedCheckpoint`, which readers stop at instead of skipping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from pcframe.distributed.placement import cover_fault
from pcframe.errors import ManifestError, UnsupportedCheckpoint
from pcframe.format.classes import base_types_unannounced
from pcframe.format.manifest import DCP_SECTION, Manifest
from pcframe.format.tree import TYPED_TAGS, TensorRef, decode_tree, encode_tree, tags_held
from pcframe.kernels.dtypes import DTYPES, dtype_name

SCHEMA = 1
SECTION = DCP_SECTION
KINDS = ("tensor", "value", "pickled")


@dataclass(frozen=True)
class Location:
    """Where one stored item is: item ``item`` of rank ``rank``'s shard."""

    rank: int
    item: int


@dataclass(frozen=True)
class StoredItem:
    """One validated item of a rank's ``dcp`` section.

    ``entry``: the manifest tensor holding its bytes (tensor and pickled items); a tensor
    item is the chunk of ``shape`` (the stored tensor's) at ``offsets`` of a tensor of global
    ``size``; a value item's ``value`` is already decoded.
    """

    fqn: str
    kind: str
    entry: int | None = None
    offsets: tuple[int, ...] = ()
    size: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()
    dtype: str = ""
    requires_grad: bool = False
    pin_memory: bool = False
    value: Any = None


@dataclass(frozen=True)
class ShardSection:
    """One rank's validated ``dcp`` section."""

    rank: int
    world_size: int
    checkpoint_id: str | None
    save_id: str
    planner_data: dict[str, tuple[str | int, ...]] | None
    items: list[StoredItem]


@dataclass
class ReadIndex:
    """The DCP view of one committed version: ``Metadata`` plus where each item is stored."""

    metadata: Metadata
    # (fqn, chunk offsets or None for non-tensors) -> where it is
    locations: dict[tuple[str, tuple[int, ...] | None], Location] = field(default_factory=dict)
    items: dict[int, list[StoredItem]] = field(default_factory=dict)  # rank -> its items
    checkpoint_id: str | None = None


def plain_value(planner: SavePlanner, item: WriteItem) -> tuple[bool, Any]:
    """``(True, encoding)`` of a non-tensor item pickle-free, ``(False, None)`` to pickle it.

    Only when the planner's bytes would be exactly ``torch.save`` of the looked-up object
    (DCP's default planner, not overridden): a planner that transforms objects keeps its
    own bytes. The value must round-trip through :mod:`pcframe.format.tree` to an equal
    object of the same types (a numpy scalar does not) and use none of the tree's standard
    subtypes (a Counter, a namedtuple, an enum: DCP's schema 1 predates them); such values
    stay pickled.
    """
    kind = type(planner)
    if not isinstance(planner, DefaultSavePlanner) or any(
        getattr(kind, name) is not getattr(DefaultSavePlanner, name)
        for name in ("resolve_data", "transform_object", "lookup_object")
    ):
        return False, None
    value = planner.lookup_object(item.index)
    refs: list[TensorRef] = []
    try:
        with base_types_unannounced():  # a type the tree would not keep stays pickled here
            encoded = encode_tree(value, "", refs)
    except (TypeError, ValueError, RecursionError):
        return False, None
    if refs or tags_held(encoded) & TYPED_TAGS or not _same(decode_tree(encoded, []), value):
        return False, None
    return True, encoded


def _same(a: Any, b: Any) -> bool:
    """Equal values of exactly the same types, all the way down (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def tensor_record(item: WriteItem, ref: int) -> dict[str, Any]:
    """The record of one tensor chunk (``ref``: its tensor index in the manifest)."""
    data = item.tensor_data
    assert data is not None
    props = data.properties
    if props.layout != torch.strided:
        raise TypeError(
            f"DCP item {item.index.fqn!r} has layout {props.layout}; pcframe stores strided "
            "(dense) tensors only: convert it with .to_dense() before saving"
        )
    return {
        "fqn": item.index.fqn,
        "kind": "tensor",
        "data": {"$t": ref},
        "offsets": list(data.chunk.offsets),
        "size": list(data.size),
        "dtype": dtype_name(props.dtype),
        "requires_grad": bool(props.requires_grad),
        "pin_memory": bool(props.pin_memory),
    }


def json_path(value: Any) -> list[str | int] | None:
    """A DCP planner mapping value (a tuple of str / int keys) as JSON, or None."""
    if isinstance(value, tuple | list) and all(
        isinstance(k, str | int) and not isinstance(k, bool) for k in value
    ):
        return list(value)
    return None


def section(
    manifest: Manifest, where: str, rank: int | None = None, world_size: int | None = None
) -> ShardSection:
    """The validated ``dcp`` section of a manifest's tree (``where``: the manifest's path).

    ``rank`` / ``world_size``: what the shard must say it is (the global record's, or 0 / 1
    for a version of a root written by one rank); not checked when ``None``.

    Raises:
        UnsupportedCheckpoint: the section is of a newer schema (a newer pcframe wrote it).
        ManifestError: one line naming ``where``, the field and what is wrong with it.
    """
    tree = manifest.tree
    body = tree.get(SECTION) if isinstance(tree, dict) else None
    if not isinstance(body, dict):
        raise ManifestError(
            f"{where}: not written by pcframe's DCP StorageWriter (no '{SECTION}' section); "
            "load it with pcframe.load() or Checkpointer.restore()"
        )
    fields = _Fields(where)
    schema = body.get("schema")
    if _plain_int(schema) and schema > SCHEMA:
        raise UnsupportedCheckpoint(
            f"{where}: field 'dcp.schema' is {schema}: written by a newer pcframe (this one "
            f"reads DCP schema {SCHEMA}); upgrade pcframe to read it"
        )
    if schema != SCHEMA or not _plain_int(schema):
        raise fields.fail("dcp.schema", f"must be {SCHEMA}, got {schema!r:.40}")
    own = fields.integer(body, "rank", 0)
    world = fields.integer(body, "world_size", 1)
    if own >= world:
        raise fields.fail("dcp.rank", f"is {own}, not below 'world_size' {world}")
    if rank is not None and own != rank:
        raise fields.fail("dcp.rank", f"is {own}, but this is rank {rank}'s shard")
    if world_size is not None and world != world_size:
        raise fields.fail("dcp.world_size", f"is {world}, but the version has {world_size}")
    checkpoint_id = body.get("checkpoint_id")
    if checkpoint_id is not None and not isinstance(checkpoint_id, str):
        raise fields.fail(
            "dcp.checkpoint_id", f"must be a string or null, got {checkpoint_id!r:.40}"
        )
    save_id = body.get("save_id")
    if not isinstance(save_id, str):
        raise fields.fail("dcp.save_id", f"must be a string, got {save_id!r:.40}")
    items = body.get("items")
    if not isinstance(items, list):
        raise fields.fail("dcp.items", f"must be a list, got {type(items).__name__}")
    return ShardSection(
        own,
        world,
        checkpoint_id,
        save_id,
        _planner_data(body.get("planner_data"), fields),
        [_item(raw, i, manifest, fields) for i, raw in enumerate(items)],
    )


class _Fields:
    """Field checks of one manifest's section: every error is one line naming the file and
    the field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, name: str, reason: str) -> ManifestError:
        return ManifestError(f"{self.where}: field '{name}' {reason}")

    def integer(self, body: dict[str, Any], key: str, lo: int) -> int:
        value = body.get(key)
        if not _plain_int(value) or value < lo:
            raise self.fail(f"dcp.{key}", f"must be an integer >= {lo}, got {value!r:.40}")
        return value

    def ints(self, item: dict[str, Any], key: str, name: str) -> tuple[int, ...]:
        value = item.get(key)
        if not isinstance(value, list) or not all(_plain_int(x) and x >= 0 for x in value):
            raise self.fail(f"{name}.{key}", f"must be a list of integers >= 0, got {value!r:.60}")
        return tuple(value)

    def flag(self, item: dict[str, Any], key: str, name: str) -> bool:
        value = item.get(key, False)
        if not isinstance(value, bool):
            raise self.fail(f"{name}.{key}", f"must be true or false, got {value!r:.40}")
        return value


def _plain_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _planner_data(raw: Any, fields: _Fields) -> dict[str, tuple[str | int, ...]] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fields.fail("dcp.planner_data", f"must be an object or null, got {raw!r:.40}")
    mappings = {}
    for fqn, path in raw.items():
        keys = json_path(path)
        if not isinstance(path, list) or keys is None:
            raise fields.fail(
                f"dcp.planner_data[{fqn!r:.60}]",
                f"must be a list of string / integer keys, got {path!r:.60}",
            )
        mappings[fqn] = tuple(keys)
    return mappings


def _item(raw: Any, i: int, manifest: Manifest, fields: _Fields) -> StoredItem:
    name = f"dcp.items[{i}]"
    if not isinstance(raw, dict):
        raise fields.fail(name, f"must be an object, got {type(raw).__name__}")
    fqn = raw.get("fqn")
    if not isinstance(fqn, str):
        raise fields.fail(f"{name}.fqn", f"must be a string, got {fqn!r:.40}")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise fields.fail(f"{name}.kind", f"is {kind!r:.40}; known: {', '.join(KINDS)}")
    if kind == "value":
        if "value" not in raw:
            raise fields.fail(f"{name}.value", f"is missing (the value of {fqn!r:.60})")
        if tags_held(raw["value"]) & TYPED_TAGS:  # the writer pickles those (a class named)
            raise fields.fail(f"{name}.value", "names a class, which a DCP value never does")
        try:  # tags were checked with the whole tree; a value holds no tensor reference
            value = decode_tree(raw["value"], [])
        except ManifestError as exc:
            why = (
                "holds a tensor reference (a DCP value holds none)"
                if "tensor reference" in str(exc)
                else f"cannot be decoded: {exc}"
            )
            raise fields.fail(f"{name}.value", why) from None
        return StoredItem(fqn, kind, value=value)
    ref = raw.get("data")
    index = ref.get("$t") if isinstance(ref, dict) and len(ref) == 1 else None
    count = len(manifest.entries)
    if not _plain_int(index) or not 0 <= index < count:
        raise fields.fail(
            f"{name}.data",
            f'must be a tensor reference {{"$t": i}} with i in 0..{count - 1}, got {ref!r:.60}',
        )
    entry = manifest.entries[index]
    if not entry.raw:
        raise fields.fail(
            f"{name}.data",
            f"names tensor {index}, stored with codec {entry.codec!r}: DCP items are stored raw",
        )
    if kind == "pickled":
        if entry.dtype != "uint8" or len(entry.shape) != 1:
            raise fields.fail(
                f"{name}.data",
                f"names a {entry.dtype} tensor of shape {list(entry.shape)}; pickled bytes "
                "are a 1-d uint8 tensor",
            )
        return StoredItem(fqn, kind, index, shape=entry.shape)
    offsets = fields.ints(raw, "offsets", name)
    size = fields.ints(raw, "size", name)
    shape = tuple(entry.shape)
    if len(offsets) != len(size) or len(shape) != len(size):
        raise fields.fail(
            f"{name}.offsets",
            f"{list(offsets)} and the stored chunk {list(shape)} do not fit 'size' {list(size)} "
            "(dimensions differ)",
        )
    if any(o + n > g for o, n, g in zip(offsets, shape, size, strict=True)):
        raise fields.fail(
            f"{name}.offsets",
            f"{list(offsets)}: the stored chunk {list(shape)} there lies outside 'size' "
            f"{list(size)}",
        )
    dtype = raw.get("dtype")
    if dtype != entry.dtype:
        raise fields.fail(
            f"{name}.dtype", f"is {dtype!r:.40}, the stored tensor's is {entry.dtype!r}"
        )
    return StoredItem(
        fqn,
        kind,
        index,
        offsets,
        size,
        shape,
        entry.dtype,
        fields.flag(raw, "requires_grad", name),
        fields.flag(raw, "pin_memory", name),
    )


def build_metadata(
    manifests: dict[int, Manifest],
    wheres: dict[int, str],
    world_size: int | None = None,
    version_where: str | None = None,
) -> ReadIndex:
    """DCP's ``Metadata`` of one version from every rank's manifest (rank -> manifest).

    ``wheres``: each rank's manifest path, named in errors; ``world_size``: the ranks that
    saved the version (each section must say so, and its own rank), when known;
    ``version_where``: the file that names the whole version (a multi-rank version's global
    record), named when part of a tensor is in no file.

    Raises:
        UnsupportedCheckpoint: a section is of a newer schema.
        ManifestError: one line naming the manifest and the field: a malformed section or
            item, ranks that disagree about an item, or chunks of a tensor that overlap or
            leave part of it uncovered.
    """
    sections = {
        rank: section(m, wheres[rank], rank if world_size else None, world_size)
        for rank, m in manifests.items()
    }
    state: dict[str, Any] = {}
    first = sections[min(sections)]
    index = ReadIndex(Metadata(state_dict_metadata=state), checkpoint_id=first.checkpoint_id)
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    sources: dict[str, list[tuple[int, int]]] = {}  # fqn -> (rank, item) of each box
    owner: dict[str, int] = {}  # fqn -> the rank whose item first described it
    mappings: dict[str, tuple[str | int, ...]] | None = {}
    for rank in sorted(sections):
        body, where = sections[rank], wheres[rank]
        if (body.checkpoint_id, body.save_id) != (first.checkpoint_id, first.save_id):
            raise ManifestError(
                f"{where}: field 'dcp.save_id' is {body.save_id!r:.40}, rank {min(sections)}'s "
                f"is {first.save_id!r:.40}: the shards are of different saves"
            )
        index.items[rank] = body.items
        if mappings is not None and body.planner_data is not None:
            mappings.update(body.planner_data)
        else:
            mappings = None  # a planner without JSON mappings: DCP gets none
        for i, item in enumerate(body.items):
            name, fqn = f"dcp.items[{i}]", item.fqn
            known = state.get(fqn)
            if item.kind != "tensor":
                if isinstance(known, TensorStorageMetadata):
                    raise ManifestError(
                        f"{where}: field '{name}.kind' is {item.kind!r} but {fqn!r:.80} is a "
                        f"tensor in {wheres[owner[fqn]]}"
                    )
                if known is None:
                    state[fqn], owner[fqn] = BytesStorageMetadata(), rank
                index.locations.setdefault((fqn, None), Location(rank, i))
                continue
            if known is None:
                known = state[fqn] = _tensor_meta(item)
                owner[fqn] = rank
            if not isinstance(known, TensorStorageMetadata):
                raise ManifestError(
                    f"{where}: field '{name}.kind' is 'tensor' but {fqn!r:.80} is a value in "
                    f"{wheres[owner[fqn]]}"
                )
            if tuple(known.size) != item.size or known.properties.dtype != DTYPES[item.dtype]:
                raise ManifestError(
                    f"{where}: field '{name}' says {fqn!r:.80} is {item.dtype} {list(item.size)}, "
                    f"{wheres[owner[fqn]]} says {dtype_name(known.properties.dtype)} "
                    f"{list(known.size)}"
                )
            key = (fqn, item.offsets)
            if key in index.locations:
                stored = index.locations[key]
                if index.items[stored.rank][stored.item].shape == item.shape:
                    continue  # the same chunk written twice (replicated): one copy is enough
                # A different chunk at the same place: the cover check names the overlap.
            else:
                index.locations[key] = Location(rank, i)
                known.chunks.append(
                    ChunkStorageMetadata(torch.Size(item.offsets), torch.Size(item.shape))
                )
            boxes.setdefault(fqn, []).append((item.offsets, item.shape))
            sources.setdefault(fqn, []).append((rank, i))
    for fqn, meta in state.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        found = cover_fault(tuple(meta.size), boxes.get(fqn, []))
        if found is None:
            continue
        problem, at_fault = found
        if at_fault:  # two chunks overlap: the files and fields of both
            (r0, i0), (r1, i1) = (sources[fqn][k] for k in at_fault)
            raise ManifestError(
                f"{wheres[r1]}: field 'dcp.items[{i1}]' (a chunk of {fqn!r:.80}, size "
                f"{list(meta.size)}) and field 'dcp.items[{i0}]' of {wheres[r0]}: {problem}"
            )
        holding = sorted({r for r, _ in sources.get(fqn, [])})
        raise ManifestError(
            f"{version_where or wheres[owner[fqn]]}: the chunks of {fqn!r:.80} (fields "
            f"'dcp.items' of rank(s) {holding}) do not tile its size {list(meta.size)}: "
            f"{problem}"
        )
    index.metadata.planner_data = mappings or None
    index.metadata.storage_meta = StorageMeta(
        checkpoint_id=first.checkpoint_id, save_id=first.save_id
    )
    return index


def _tensor_meta(item: StoredItem) -> TensorStorageMetadata:
    properties = TensorProperties(
        dtype=DTYPES[item.dtype],
        requires_grad=item.requires_grad,
        pin_memory=item.pin_memory,
    )
    return TensorStorageMetadata(properties, torch.Size(item.size), [])
