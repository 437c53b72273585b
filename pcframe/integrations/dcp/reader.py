"""``StorageReader``: ``dcp.load`` from pcframe versions, every chunk verified while read.

DCP's ``Metadata`` is built from the JSON manifests (:func:`schema.build_metadata`); nothing
is unpickled by pcframe. Tensor chunks are read with the engine's one reader
(:func:`pcframe.restore.reader.read_entries`: parallel ``preadv``, each chunk's checksum
checked), one rank's shard at a time, and copied into the tensors DCP's planner resolves
(any device). Non-tensor items stored as JSON values are handed to the planner as
``torch.save`` bytes of the decoded value, so DCP's ``torch.load`` only ever reads bytes
pcframe made itself; items that were stored pickled are refused unless
``allow_pickle=True`` (DCP's default planner unpickles them with ``weights_only=False``).
"""

from __future__ import annotations

import io
import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from pcframe.errors import CheckpointError, CorruptCheckpoint, NoValidCheckpoint
from pcframe.format.names import check_requested_version
from pcframe.format.tree import decode_tree
from pcframe.integrations.dcp import root as roots
from pcframe.integrations.dcp.schema import ReadIndex, build_metadata, section
from pcframe.restore.reader import read_entries
from pcframe.runtime.collector import collector_paused

log = logging.getLogger("pcframe")


class StorageReader(_DcpStorageReader):
    """Read a ``dcp.load`` checkpoint from a pcframe root written by :class:`StorageWriter`.

    Args:
        path: the pcframe root (``None``: the ``checkpoint_id`` of the load is the root).
        version: the version to load; by default the newest one whose manifests verify
            (a damaged newer one is skipped with a warning). A ``checkpoint_id`` that is
            not the root selects the version saved with that ``checkpoint_id``.
        allow_pickle: load non-tensor items that were stored as pickled bytes (values
            pcframe's JSON tree cannot hold); DCP's planner unpickles those, so only for
            checkpoints you trust.
        threads: reader threads per shard.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        version: int | None = None,
        allow_pickle: bool = False,
        threads: int = 8,
    ) -> None:
        super().__init__()
        check_requested_version(version, "StorageReader(version=...)")
        self.root = Path(path) if path is not None else None
        self.version = version
        self.allow_pickle = allow_pickle
        self.threads = threads
        self.checkpoint_id: str | None = None
        self.loaded: roots.Committed | None = None  # the version read_metadata chose
        self._index: ReadIndex | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if self.root is None and checkpoint_id is not None:
            self.root = Path(checkpoint_id)
        self.checkpoint_id = None if checkpoint_id is None else str(checkpoint_id)
        self.loaded = self._index = None

    def read_metadata(self, *args: Any) -> Metadata:  # no **kwargs: see the module notes
        """The chosen version's DCP ``Metadata`` (its manifests validated)."""
        if self.root is None:
            raise ValueError(
                "pcframe StorageReader has no directory: give StorageReader(path) or "
                "dcp.load(..., checkpoint_id=path)"
            )
        label = self.checkpoint_id
        if label is not None and Path(label) == self.root:
            label = None
        if self.version is not None:
            self.loaded, self._index = self._open(self.version)
        elif label is not None:
            self.loaded, self._index = self._labelled(label)
        else:
            self.loaded, self._index = self._newest()
        return self._index.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        del metadata, is_coordinator, args, kwargs

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read, verify and place this rank's items, one saved rank's shard at a time."""
        loaded, index = self.loaded, self._index
        if loaded is None or index is None:
            raise CheckpointError("StorageReader.read_data before read_metadata")
        by_rank: dict[int, list[tuple[ReadItem, dict[str, Any]]]] = defaultdict(list)
        for read in plan.items:
            offset = read.storage_index.offset
            key = (read.storage_index.fqn, tuple(offset) if offset is not None else None)
            location = index.locations.get(key)
            if location is None:
                raise CheckpointError(
                    f"{loaded.where}: holds no item {key[0]!r} at {key[1]} (the load plan "
                    "does not match this version's metadata)"
                )
            by_rank[location.rank].append((read, index.items[location.rank][location.item]))
        # As in pcframe's own restores (pcframe.runtime.collector): no full collections of the whole
        # process set off among the read's short-lived objects; a failed shard's cycle is
        # freed when the pause ends.
        with collector_paused():
            for rank in sorted(by_rank):
                self._read_shard(rank, by_rank[rank], planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a pcframe root holding a committed version."""
        try:
            return bool(roots.candidates(Path(checkpoint_id)))
        except (OSError, TypeError):
            return False

    # --- choosing the version ---------------------------------------------------------------

    def _open(self, version: int) -> tuple[roots.Committed, ReadIndex]:
        assert self.root is not None
        committed = roots.open_version(self.root, version)
        return committed, build_metadata(committed.manifests, committed.where)

    def _newest(self) -> tuple[roots.Committed, ReadIndex]:
        assert self.root is not None
        skipped = []
        for version in roots.candidates(self.root):
            try:
                return self._open(version)
            except (CheckpointError, OSError) as exc:
                log.warning("skipping checkpoint version %d in %s: %s", version, self.root, exc)
                skipped.append(f"v{version}: {exc}")
        detail = f" ({'; '.join(skipped)})" if skipped else ""
        raise NoValidCheckpoint(
            f"{self.root}: no committed pcframe version to load{detail}; check the path "
            f"(`pcframe list {self.root}`)"
        )

    def _labelled(self, label: str) -> tuple[roots.Committed, ReadIndex]:
        assert self.root is not None
        seen = []
        for version in roots.candidates(self.root):
            try:
                committed = roots.open_version(self.root, version)
                saved = section(committed.manifests[0], committed.where).get("checkpoint_id")
            except (CheckpointError, OSError):
                continue
            if saved == label:
                return committed, build_metadata(committed.manifests, committed.where)
            seen.append(f"v{version}: {saved!r}")
        raise NoValidCheckpoint(
            f"{self.root}: no committed version was saved with checkpoint_id {label!r} (have "
            f"{', '.join(seen) or 'none'}); pass StorageReader(root) for the newest"
        )

    # --- reading ----------------------------------------------------------------------------

    def _read_shard(
        self, rank: int, reads: list[tuple[ReadItem, dict[str, Any]]], planner: LoadPlanner
    ) -> None:
        loaded = self.loaded
        assert loaded is not None
        directory, manifest = loaded.directories[rank], loaded.manifests[rank]
        for _, item in reads:  # refuse before reading anything
            if item["kind"] == "pickled" and not self.allow_pickle:
                raise CheckpointError(
                    f"{directory}: '{item['fqn']}' was stored as pickled bytes (not a JSON-able "
                    "value when saved) and DCP's planner would unpickle it with torch.load("
                    "weights_only=False); pass StorageReader(..., allow_pickle=True) if you "
                    "trust this checkpoint, or save that value as tensors / JSON-able data"
                )
        wanted = {item["data"]["$t"] for _, item in reads if item["kind"] != "value"}
        try:
            tensors = read_entries(directory, manifest, wanted, threads=self.threads)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(
                f"{exc}; version {loaded.version} is damaged: load an older one with "
                f"StorageReader(root, version=N) (`pcframe verify` lists the damaged ones)"
            ) from None
        for read, item in reads:
            if item["kind"] == "value":
                planner.load_bytes(read, _saved(decode_tree(item["value"], [])))
            elif item["kind"] == "pickled":
                raw = tensors[item["data"]["$t"]].numpy().tobytes()
                planner.load_bytes(read, io.BytesIO(raw))
            else:
                _place(read, tensors[item["data"]["$t"]], planner, item["fqn"], directory)


def _saved(value: Any) -> io.BytesIO:
    """``torch.save`` bytes of a value decoded from JSON: what DCP's planner expects."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def _place(
    read: ReadItem, stored: torch.Tensor, planner: LoadPlanner, fqn: str, where: Path
) -> None:
    """Copy the requested part of a stored chunk into the tensor the planner resolves."""
    if read.type != LoadItemType.TENSOR:
        raise CheckpointError(f"{where}: '{fqn}' is a tensor, the load plan reads it as bytes")
    source = stored
    for dim, (start, length) in enumerate(zip(read.storage_offsets, read.lengths, strict=True)):
        source = source.narrow(dim, start, length)
    target = planner.resolve_tensor(read).detach()
    if target.size() != source.size():
        raise CheckpointError(
            f"{where}: '{fqn}' part {list(source.size())} does not fit the destination "
            f"{list(target.size())}"
        )
    target.copy_(source)
    planner.commit_tensor(read, target)
