"""What one global version holds: every rank's shard manifest, indexed by state tensor.

Each rank's tree (see :mod:`pcframe.distributed.capture`) says which tensors that rank wrote:
whole replicated tensors, or boxes of sharded ones with their global shape and offset.
:class:`SavedIndex` reads all of them (each manifest checked against the checksum the global
record pinned) and lists, per tensor name, where its boxes are stored. Everything read from
a manifest is validated, so a hostile or damaged manifest raises ``ManifestError`` naming it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcframe.distributed.global_versions import GlobalRecord
from pcframe.distributed.placement import Box
from pcframe.errors import CheckpointError, CorruptCheckpoint, ManifestError
from pcframe.format.manifest import MANIFEST_NAME, Manifest, manifest_crc, read_manifest
from pcframe.format.names import version_name


@dataclass(frozen=True)
class ShardSource:
    """Where one stored box of a tensor is: entry ``entry`` of saved rank ``rank``'s shard."""

    rank: int
    entry: int
    box: Box


@dataclass
class SavedItem:
    name: str
    dtype: str
    global_shape: tuple[int, ...]
    sharded: bool
    sources: list[ShardSource] = field(default_factory=list)


class SavedIndex:
    """What one global version holds, gathered from every rank's shard manifest."""

    def __init__(
        self,
        root: Path,
        record: GlobalRecord,
        locate: Callable[[int, int], Path] | None = None,
    ) -> None:
        """``locate(rank, version)``: where a shard is read from when not at its place in
        ``root`` (a copy a restore fetched from a peer or the object store)."""
        self.root, self.record, self._locate = root, record, locate
        self.manifests: dict[int, Manifest] = {}
        self.items: dict[str, SavedItem] = {}
        # Non-tensor model/optimizer entries: their names (in order), and the encoded node
        # each rank wrote (they may differ per rank; see value()).
        self.value_names: dict[str, None] = {}
        self.values_of: dict[int, dict[str, Any]] = {}
        for shard in record.shards:
            directory = self.directory(shard.rank)
            manifest = read_manifest(str(directory / MANIFEST_NAME))
            if manifest.version != shard.version:
                raise CorruptCheckpoint(
                    f"{directory}: holds version {manifest.version}, the global record "
                    f"expects {shard.version}"
                )
            if manifest_crc(directory / MANIFEST_NAME) != shard.manifest_crc32c:
                raise CorruptCheckpoint(
                    f"{directory / MANIFEST_NAME}: does not match the global record of version "
                    f"{record.version} (manifest checksum differs): this shard was replaced"
                )
            self.manifests[shard.rank] = manifest
            self._index(shard.rank, manifest)

    @property
    def world_size(self) -> int:
        return self.record.world_size

    def directory(self, rank: int) -> Path:
        shard = self.record.shards[rank]
        if self._locate is not None:
            return self._locate(rank, shard.version)
        directory = self.root / shard.directory / version_name(shard.version)
        for folder in (directory.parent, directory):
            if os.path.islink(folder):  # the root itself may be a link, nothing in it
                raise CheckpointError(
                    f"{folder} is a link: pcframe never reads a shard through a link inside "
                    "a checkpoint; put the folder it points to in its place"
                )
        return directory

    def value(self, name: str, rank: int) -> tuple[int, Any]:
        """``(rank, encoded node)`` of a non-tensor entry: ``rank``'s own (every rank writes
        its own: they may differ, e.g. a counter in ``get_extra_state``), else the lowest
        rank's. Tensors inside it are references into that rank's manifest."""
        own = self.values_of.get(rank, {})
        if name in own:
            return rank, own[name]
        for other in sorted(self.values_of):
            if name in self.values_of[other]:
                return other, self.values_of[other][name]
        raise KeyError(name)

    def section(self, rank: int, name: str) -> Any:
        tree = self.manifests[rank].tree
        return tree.get(name) if isinstance(tree, dict) else None

    def _index(self, rank: int, manifest: Manifest) -> None:
        where = f"{self.directory(rank) / MANIFEST_NAME}"
        model = self.section(rank, "model")
        if model is not None:
            for key, node in mapping(model, where, "model").items():
                self._add(f"model/{key}", node, rank, manifest, where)
        optimizer = self.section(rank, "optimizer")
        if optimizer is not None:
            state = mapping(mapping(optimizer, where, "optimizer").get("state"), where, "state")
            for index, entries in state.items():
                for key, node in mapping(entries, where, f"state/{index}").items():
                    self._add(f"optimizer/{index}/{key}", node, rank, manifest, where)

    def _add(self, name: str, node: Any, rank: int, manifest: Manifest, where: str) -> None:
        node = mapping(node, where, name)
        kind = node.get("kind")
        if kind == "value":
            self.value_names.setdefault(name)
            self.values_of.setdefault(rank, {})[name] = node.get("value")
            return
        if kind not in ("replicated", "shard"):
            raise ManifestError(f"{where}: '{name}' has unknown kind {kind!r}")
        ref = node.get("data")
        index = ref.get("$t") if isinstance(ref, dict) else None
        if not isinstance(index, int) or not 0 <= index < len(manifest.entries):
            raise ManifestError(f"{where}: '{name}' has no valid tensor reference")
        entry = manifest.entries[index]
        if kind == "replicated":
            global_shape, box = entry.shape, Box.full(entry.shape)
        else:
            global_shape = _int_list(node.get("global_shape"), where, name)
            offset = _int_list(node.get("offset"), where, name)
            box = Box(offset, entry.shape)
            if (
                len(offset) != len(global_shape)
                or len(entry.shape) != len(global_shape)
                or any(o + n > g for o, n, g in zip(offset, entry.shape, global_shape, strict=True))
            ):
                raise ManifestError(f"{where}: shard of '{name}' lies outside {global_shape}")
        item = self.items.setdefault(
            name, SavedItem(name, entry.dtype, global_shape, kind == "shard")
        )
        if (item.dtype, item.global_shape, item.sharded) != (
            entry.dtype,
            global_shape,
            kind == "shard",
        ):
            raise ManifestError(f"{where}: '{name}' disagrees with another rank's shard of it")
        if not item.sharded and item.sources:
            return  # a replicated tensor written twice (older planner): one copy is enough
        item.sources.append(ShardSource(rank, index, box))


def mapping(node: Any, where: str, what: str) -> dict[str, Any]:
    if not isinstance(node, dict):
        raise ManifestError(f"{where}: '{what}' must be an object")
    return node


def _int_list(value: Any, where: str, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ManifestError(f"{where}: '{name}' has an invalid shape or offset {value!r}")
    return tuple(value)
