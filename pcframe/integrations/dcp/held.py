"""One committed version held for a DCP load, and placing what was read.

:class:`HeldVersion` is a version opened by the reader: its manifests and DCP index, and,
once DCP's plan is known, the data files of the shards the plan reads, held open so that a
live writer's retention deleting the version cannot touch the read (an open descriptor
reads a deleted file). :meth:`HeldVersion.locate` maps each read of a plan to the stored
item it takes and checks that it fits (also when the version replaces a pruned one the
plan was made with); :func:`placement` resolves and checks where every verified item goes, and
:meth:`Placement.place` hands them to DCP's planner once every rank of the load agreed.
"""

from __future__ import annotations

import errno
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from pcframe.errors import CheckpointError, CorruptCheckpoint, ManifestError, RestoreIOError
from pcframe.integrations.dcp import root as roots
from pcframe.integrations.dcp.schema import ReadIndex, StoredItem
from pcframe.kernels.dtypes import DTYPES
from pcframe.restore.chunk_io import DataFiles
from pcframe.restore.sources import describe_io

# What a missing file or folder looks like: damage, or a version a live writer pruned.
_MISSING = (errno.ENOENT, errno.ENOTDIR)


@dataclass
class Read:
    """One item of a load plan and the stored item it reads."""

    read: ReadItem
    rank: int
    item: StoredItem


@dataclass
class HeldVersion:
    """One committed version opened for reading: manifests, DCP index, and the data files
    of the shards a load reads, held open from the moment the plan is known."""

    committed: roots.Committed
    index: ReadIndex
    files: dict[int, DataFiles] = field(default_factory=dict)

    def locate(self, plan: LoadPlan, planned: ReadIndex | None) -> list[Read]:
        """The stored item of every read, each checked to fit it; ``planned``: the index
        DCP planned with (another version's, if this one replaces a pruned one).

        Raises:
            CheckpointError: one line naming the item, when the plan does not fit.
        """
        where, reads = self.committed.where, []
        if (
            planned is not None
            and planned is not self.index
            and planned.metadata.planner_data != self.index.metadata.planner_data
        ):
            raise CheckpointError(
                f"{where}: its state dict's key mapping is not the one this load was "
                "planned with (from a version deleted meanwhile); load again"
            )
        for read in plan.items:
            fqn, offset = read.storage_index.fqn, read.storage_index.offset
            key = (fqn, tuple(offset) if offset is not None else None)
            location = self.index.locations.get(key)
            if location is None:
                raise CheckpointError(
                    f"{where}: holds no item {fqn!r} at {key[1]} (the load plan does not match "
                    "this version's metadata)"
                )
            item = self.index.items[location.rank][location.item]
            _check_fits(read, item, where, planned)
            reads.append(Read(read, location.rank, item))
        return reads

    def hold(self, reads: list[Read]) -> None:
        """Open the data files of every shard ``reads`` need (those not open yet).

        Raises:
            ManifestError: a file is missing (damage, or pruned: the caller tells which).
            RestoreIOError: a file cannot be opened (permissions, no descriptors left).
        """
        for rank in sorted({r.rank for r in reads if r.item.entry is not None}):
            if rank in self.files:
                continue
            directory = self.committed.directories[rank]
            try:
                files = data_files(directory, self.committed.manifests[rank])
                files.open()
            except FileNotFoundError as exc:
                raise CorruptCheckpoint(f"{exc.filename}: data file is missing") from None
            except OSError as exc:
                raise RestoreIOError(
                    f"cannot open the data files of {directory}: {describe_io(exc)}; nothing was "
                    "placed: fix the storage (or free file descriptors) and load again"
                ) from None
            self.files[rank] = files

    def let_go(self) -> None:
        files, self.files = self.files, {}
        for held in files.values():
            held.close()


def _check_fits(read: ReadItem, item: StoredItem, where: str, planned: ReadIndex | None) -> None:
    fqn = item.fqn
    meta = planned.metadata.state_dict_metadata.get(fqn) if planned is not None else None
    if item.kind != "tensor":
        if read.type == LoadItemType.TENSOR or isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{where}: '{fqn}' is not a tensor, the load plan reads one")
        return
    if read.type != LoadItemType.TENSOR:
        raise CheckpointError(f"{where}: '{fqn}' is a tensor, the load plan reads it as bytes")
    if meta is not None and (
        not isinstance(meta, TensorStorageMetadata)
        or tuple(meta.size) != item.size
        or meta.properties.dtype != DTYPES[item.dtype]
    ):
        raise CheckpointError(
            f"{where}: '{fqn}' is {item.dtype} {list(item.size)}, not what this load was "
            "planned with (from a version deleted meanwhile); load again"
        )
    starts, lengths = tuple(read.storage_offsets), tuple(read.lengths)
    if (
        len(starts) != len(item.shape)
        or len(lengths) != len(item.shape)
        or any(
            s < 0 or n < 0 or s + n > d for s, n, d in zip(starts, lengths, item.shape, strict=True)
        )
    ):
        raise CheckpointError(
            f"{where}: the load plan reads {list(lengths)} at {list(starts)} of the chunk "
            f"{list(item.shape)} at {list(item.offsets)} of '{fqn}', which does not hold it"
        )


@dataclass
class Placement:
    """Every verified item of a load, its destination resolved and checked, not placed yet:
    :func:`placement` makes it (what can fail on this rank fails there, before the ranks
    agree), :meth:`place` places it (after they agreed)."""

    planner: LoadPlanner
    values: list[Read]
    pickled: list[tuple[Read, bytes]]
    tensors: list[tuple[ReadItem, torch.Tensor, torch.Tensor]]

    def place(self) -> None:
        """Hand every item to the planner. (A planner of the user's own whose
        ``commit_tensor`` raises after others were placed is not rolled back.)"""
        for read in self.values:
            self.planner.load_bytes(read.read, _saved(read.item.value))
        for read, raw in self.pickled:
            self.planner.load_bytes(read.read, io.BytesIO(raw))
        for read_item, source, target in self.tensors:
            target.copy_(source)
            self.planner.commit_tensor(read_item, target)


def placement(
    reads: list[Read],
    stored: dict[tuple[int, int], torch.Tensor],
    planner: LoadPlanner,
    committed: roots.Committed,
) -> Placement:
    """Every destination tensor resolved and checked, and every pickled value unpickled once
    (DCP's planner unpickles them the same way: it fails here, or not), placing nothing: a
    load that cannot be placed on some rank fails before any rank places a byte."""
    tensors = [
        _placement(read, stored, planner, committed.directories[read.rank])
        for read in reads
        if read.item.kind == "tensor"
    ]
    pickled = [(read, _raw(read, stored)) for read in reads if read.item.kind == "pickled"]
    for _, raw in pickled:
        torch.load(io.BytesIO(raw), weights_only=False)
    values = [read for read in reads if read.item.kind == "value"]
    return Placement(planner, values, pickled, tensors)


def _raw(read: Read, stored: dict[tuple[int, int], torch.Tensor]) -> bytes:
    assert read.item.entry is not None
    return stored[read.rank, read.item.entry].numpy().tobytes()


def _saved(value: Any) -> io.BytesIO:
    """``torch.save`` bytes of a value decoded from JSON: what DCP's planner expects."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def _placement(
    read: Read, stored: dict[tuple[int, int], torch.Tensor], planner: LoadPlanner, where: Path
) -> tuple[ReadItem, torch.Tensor, torch.Tensor]:
    """The requested part of a stored chunk and the tensor the planner resolves for it,
    checked to take it: the same size, and memory of its own for every element (``copy_``
    refuses a broadcast view, e.g. a buffer registered as ``torch.zeros(1).expand(n)``)."""
    assert read.item.entry is not None
    fqn, source = read.item.fqn, stored[read.rank, read.item.entry]
    for dim, (start, length) in enumerate(
        zip(read.read.storage_offsets, read.read.lengths, strict=True)
    ):
        source = source.narrow(dim, start, length)
    target = planner.resolve_tensor(read.read).detach()
    if target.size() != source.size():
        raise CheckpointError(
            f"{where}: '{fqn}' part {list(source.size())} does not fit the destination "
            f"{list(target.size())}; nothing was placed"
        )
    if any(step == 0 and n > 1 for step, n in zip(target.stride(), target.size(), strict=True)):
        raise CheckpointError(
            f"{where}: '{fqn}' cannot be loaded into its destination "
            f"'{read.read.dest_index.fqn}', a broadcast view (several elements share one "
            "memory location, as torch.zeros(1).expand(n) does); give it a tensor with memory "
            "of its own (e.g. .clone()); nothing was placed"
        )
    return read.read, source, target


def data_files(directory: Path, manifest: Any) -> DataFiles:
    """The version's data files, each checked to be there at its size (not opened)."""
    try:
        return DataFiles(directory, manifest)
    except OSError as exc:
        if exc.errno in _MISSING:
            raise CorruptCheckpoint(f"{exc.filename}: missing ({exc.strerror})") from None
        raise


def damaged(exc: ManifestError, opened: HeldVersion) -> CorruptCheckpoint:
    version = opened.committed.version
    return CorruptCheckpoint(
        f"{exc}; version {version} is damaged and nothing was placed: load an older one with "
        f"StorageReader(root, version=N) (`pcframe verify` lists the damaged ones)"
    )
