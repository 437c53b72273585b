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

from pcframe.errors import ManifestError
from pcframe.format.manifest import Manifest
from pcframe.format.tree import TensorRef, decode_tree, encode_tree
from pcframe.kernels.dtypes import DTYPES, dtype_name

SCHEMA = 1
SECTION = "dcp"
KINDS = ("tensor", "value", "pickled")


@dataclass(frozen=True)
class Location:
    """Where one stored item is: item ``item`` of rank ``rank``'s shard."""

    rank: int
    item: int


@dataclass
class ReadIndex:
    """The DCP view of one committed version: ``Metadata`` plus where each item is stored."""

    metadata: Metadata
    # (fqn, chunk offsets or None for non-tensors) -> where it is
    locations: dict[tuple[str, tuple[int, ...] | None], Location] = field(default_factory=dict)
    items: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # rank -> its items


def plain_value(planner: SavePlanner, item: WriteItem) -> tuple[bool, Any]:
    """``(True, encoding)`` of a non-tensor item pickle-free, ``(False, None)`` to pickle it.

    Only when the planner's bytes would be exactly ``torch.save`` of the looked-up object
    (DCP's default planner, not overridden): a planner that transforms objects keeps its
    own bytes. The value must round-trip through :mod:`pcframe.format.tree` to an equal
    object of the same types (a numpy scalar or a namedtuple does not: it stays pickled).
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
        encoded = encode_tree(value, "", refs)
    except (TypeError, ValueError, RecursionError):
        return False, None
    if refs or not _same(decode_tree(encoded, []), value):
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


def section(manifest: Manifest, where: str) -> dict[str, Any]:
    """The validated ``dcp`` section of a manifest's tree.

    Raises:
        ManifestError: naming ``where`` (the manifest) and what is wrong.
    """
    tree = manifest.tree
    body = tree.get(SECTION) if isinstance(tree, dict) else None
    if not isinstance(body, dict):
        raise ManifestError(
            f"{where}: not written by pcframe's DCP StorageWriter (no '{SECTION}' section); "
            "load it with pcframe.load() or Checkpointer.restore()"
        )
    if body.get("schema") != SCHEMA:
        raise ManifestError(
            f"{where}: DCP section schema {body.get('schema')!r} is not supported (this pcframe "
            f"reads {SCHEMA}); upgrade pcframe"
        )
    items = body.get("items")
    if not isinstance(items, list):
        raise ManifestError(f"{where}: DCP section has no item list")
    for i, item in enumerate(items):
        _check_item(item, i, manifest, where)
    return body


def _check_item(item: Any, i: int, manifest: Manifest, where: str) -> None:
    def fail(reason: str) -> ManifestError:
        return ManifestError(f"{where}: DCP item {i}: {reason}")

    if not isinstance(item, dict) or not isinstance(item.get("fqn"), str):
        raise fail("must be an object with a string 'fqn'")
    kind = item.get("kind")
    if kind not in KINDS:
        raise fail(f"unknown kind {kind!r:.40}; known: {', '.join(KINDS)}")
    if kind == "value":
        return  # the whole tree was validated with the manifest (format.tree.check_tree)
    ref = item.get("data")
    index = ref.get("$t") if isinstance(ref, dict) else None
    if not isinstance(index, int) or not 0 <= index < len(manifest.entries):
        raise fail("has no valid tensor reference")
    entry = manifest.entries[index]
    if kind == "pickled":
        if entry.dtype != "uint8" or len(entry.shape) != 1:
            raise fail(f"pickled bytes must be a 1-d uint8 tensor, got {entry.dtype}")
        return
    offsets, size = item.get("offsets"), item.get("size")
    if not _is_int_list(offsets) or not _is_int_list(size):
        raise fail("'offsets' and 'size' must be lists of integers")
    shape = entry.shape
    if len(offsets) != len(size) or len(shape) != len(size):
        raise fail(f"chunk {list(shape)} at {offsets} does not fit a tensor of size {size}")
    if any(o < 0 or o + n > g for o, n, g in zip(offsets, shape, size, strict=True)):
        raise fail(f"chunk {list(shape)} at {offsets} lies outside size {size}")
    if item.get("dtype") != entry.dtype:
        raise fail(f"dtype {item.get('dtype')!r:.40} differs from the stored {entry.dtype}")


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    )


def build_metadata(manifests: dict[int, Manifest], where: str) -> ReadIndex:
    """DCP's ``Metadata`` of one version from every rank's manifest (rank -> manifest).

    ``where`` names the version (its directory) in errors.

    Raises:
        ManifestError: a ``dcp`` section is malformed, ranks disagree about an item, or a
            tensor's chunks do not cover it.
    """
    sections = {rank: section(m, f"{where} (rank {rank})") for rank, m in manifests.items()}
    state: dict[str, Any] = {}
    index = ReadIndex(Metadata(state_dict_metadata=state))
    covered: dict[str, int] = {}
    mappings: dict[str, tuple[str | int, ...]] | None = {}
    first = sections[min(sections)]
    for rank in sorted(sections):
        body = sections[rank]
        index.items[rank] = body["items"]
        planner_data = body.get("planner_data")
        if mappings is not None and isinstance(planner_data, dict):
            for fqn, path in planner_data.items():
                if json_path(path) is not None:
                    mappings[fqn] = tuple(path)
        else:
            mappings = None  # a planner without JSON mappings: DCP gets none
        for i, item in enumerate(body["items"]):
            fqn = item["fqn"]
            if item["kind"] != "tensor":
                if isinstance(state.get(fqn), TensorStorageMetadata):
                    raise ManifestError(f"{where}: '{fqn}' is a tensor on one rank, not another")
                state[fqn] = BytesStorageMetadata()
                index.locations.setdefault((fqn, None), Location(rank, i))
                continue
            meta = state.setdefault(fqn, _tensor_meta(item))
            if (
                not isinstance(meta, TensorStorageMetadata)
                or list(meta.size) != item["size"]
                or (meta.properties.dtype != DTYPES[item["dtype"]])
            ):
                raise ManifestError(f"{where}: ranks disagree about tensor '{fqn}'")
            key = (fqn, tuple(item["offsets"]))
            if key in index.locations:
                continue  # the same chunk written twice (replicated): one copy is enough
            shape = torch.Size(manifests[rank].entries[item["data"]["$t"]].shape)
            meta.chunks.append(ChunkStorageMetadata(torch.Size(item["offsets"]), shape))
            index.locations[key] = Location(rank, i)
            covered[fqn] = covered.get(fqn, 0) + math.prod(shape)
    for fqn, meta in state.items():
        if isinstance(meta, TensorStorageMetadata) and covered.get(fqn) != math.prod(meta.size):
            raise ManifestError(
                f"{where}: the stored chunks of '{fqn}' cover {covered.get(fqn)} of its "
                f"{math.prod(meta.size)} elements (a rank's shard is missing)"
            )
    index.metadata.planner_data = mappings or None
    index.metadata.storage_meta = StorageMeta(
        checkpoint_id=first.get("checkpoint_id"), save_id=first.get("save_id")
    )
    return index


def _tensor_meta(item: dict[str, Any]) -> TensorStorageMetadata:
    properties = TensorProperties(
        dtype=DTYPES[item["dtype"]],
        requires_grad=bool(item.get("requires_grad", False)),
        pin_memory=bool(item.get("pin_memory", False)),
    )
    return TensorStorageMetadata(properties, torch.Size(item["size"]), [])
