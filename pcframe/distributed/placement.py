"""Where a tensor's values live across ranks: replicated everywhere, or a box of a DTensor.

A plain tensor in model or optimizer state is taken to be replicated (DDP keeps every rank's
copy identical). A DTensor is described by its placements: ``Replicate`` mesh dimensions hold
copies, ``Shard(d)`` mesh dimensions cut tensor dimension ``d`` the way ``torch.chunk`` does.
Each rank's piece is then an n-dimensional box ``(offset, shape)`` of the global tensor. Boxes
are what the checkpoint records and what restore intersects, so any old layout can be read
into any new one as long as the global shapes agree.

``torch.distributed.tensor`` is never imported here: it costs seconds, and a process that
holds a DTensor has necessarily imported it already, so it is looked up in ``sys.modules``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from pcframe.errors import CheckpointError


@dataclass(frozen=True)
class Box:
    """An axis-aligned block of a tensor: ``offset`` and ``shape`` per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box | None:
        """The common block, or ``None`` if the boxes do not overlap (0-d boxes always do)."""
        offset, shape = [], []
        for a0, an, b0, bn in zip(self.offset, self.shape, other.offset, other.shape, strict=True):
            lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
            if hi <= lo:
                return None
            offset.append(lo)
            shape.append(hi - lo)
        return Box(tuple(offset), tuple(shape))

    def slices_within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box inside a tensor that holds ``outer``."""
        return tuple(
            slice(o - p, o - p + n)
            for o, n, p in zip(self.offset, self.shape, outer.offset, strict=True)
        )


@dataclass(frozen=True)
class Placed:
    """One state tensor as this rank holds it.

    Attributes:
        local: the tensor data on this rank (a DTensor's local part, or the tensor itself).
        global_shape: shape of the whole logical tensor.
        box: this rank's block; ``None`` for replicated state (the whole tensor).
        writer: for a box, whether this rank is the one that persists it (one rank per box).
        mesh, placements: the DTensor layout, to rebuild a DTensor on restore.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    box: Box | None = None
    writer: bool = True
    mesh: Any = None
    placements: tuple[Any, ...] = ()

    @property
    def sharded(self) -> bool:
        return self.box is not None

    @property
    def target_box(self) -> Box:
        return self.box if self.box is not None else Box.full(self.global_shape)


def dtensor_class() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(value: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(value, cls)


def placement_of(name: str, value: torch.Tensor) -> Placed:
    """How ``value`` (a plain tensor or a DTensor) is laid out across ranks.

    Raises:
        CheckpointError: for placements that cannot be written as disjoint boxes.
    """
    if not is_dtensor(value):
        return Placed(value.detach(), tuple(value.shape))
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = value.device_mesh, tuple(value.placements)
    global_shape = tuple(value.shape)
    local = value.to_local().detach()
    for placement in placements:
        if not isinstance(placement, Shard | Replicate):
            raise CheckpointError(
                f"state tensor '{name}' is a DTensor with placement {placement!r}; pcframe "
                "checkpoints Shard and Replicate placements only: redistribute it (e.g. "
                "Partial -> Replicate) or call full_tensor() in its state_dict()"
            )
    if all(isinstance(p, Replicate) for p in placements):
        return Placed(local, global_shape, mesh=mesh, placements=placements)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise CheckpointError(f"state tensor '{name}': this rank is not part of its device mesh")
    box = shard_box(global_shape, tuple(mesh.shape), tuple(coordinate), placements, name)
    if box.shape != tuple(local.shape):
        raise CheckpointError(
            f"state tensor '{name}': its local shape {tuple(local.shape)} is not the "
            f"torch.chunk block {box.shape} that placements {placements} give; this DTensor "
            "layout is not supported for checkpointing"
        )
    # Copies along Replicate mesh dimensions are identical: only coordinate 0 writes.
    writer = all(coordinate[i] == 0 for i, p in enumerate(placements) if isinstance(p, Replicate))
    return Placed(local, global_shape, box, writer, mesh, placements)


def shard_box(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Any, ...],
    name: str = "",
) -> Box:
    """This coordinate's block: ``Shard(d)`` cuts dim ``d`` like ``torch.chunk``, in mesh order."""
    offset, size = [0] * len(global_shape), list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        dim = getattr(placement, "dim", None)
        if dim is None:
            continue  # Replicate
        if not -len(size) <= dim < len(size):
            raise CheckpointError(f"'{name}': Shard({dim}) of a {len(size)}-d tensor")
        dim %= len(size)
        parts, index = mesh_shape[mesh_dim], coordinate[mesh_dim]
        chunk = -(-size[dim] // parts)
        start = min(size[dim], chunk * index)
        size[dim], offset[dim] = max(0, min(size[dim], start + chunk) - start), offset[dim] + start
    return Box(tuple(offset), tuple(size))


def rebuild(local: torch.Tensor, like: Placed) -> Any:
    """Wrap ``local`` back into a DTensor laid out like ``like`` (or return it unchanged)."""
    if like.mesh is None:
        return local
    from torch.distributed.tensor import DTensor

    stride = torch.empty(like.global_shape, device="meta").stride()
    return DTensor.from_local(
        local, like.mesh, like.placements, run_check=False, shape=like.global_shape, stride=stride
    )


def cover_problem(
    size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> str | None:
    """What keeps ``boxes`` (``(offsets, shape)`` each, every one already inside ``size``)
    from being disjoint pieces that cover a tensor of ``size`` exactly; ``None`` if they are."""
    found = cover_fault(size, boxes)
    return None if found is None else found[0]


def cover_fault(
    size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> tuple[str, tuple[int, ...]] | None:
    """:func:`cover_problem`, with the indices of the boxes at fault (two that overlap).

    Disjoint boxes inside the tensor cover it exactly iff their volumes add up to its own,
    so overlaps are looked for first: a sweep along the dimension where the boxes start at
    the most places, comparing only boxes whose extents along it overlap (a few per box for
    sharding by rows, by columns or in a grid, rather than every pair).
    """
    if not size:  # a 0-d tensor: one chunk, () at ()
        if len(boxes) > 1:
            return f"{len(boxes)} chunks of a 0-d tensor", (0, 1)
    else:
        solid = [k for k, (_, shape) in enumerate(boxes) if math.prod(shape) > 0]
        axis = max(range(len(size)), key=lambda d: len({boxes[k][0][d] for k in solid}))
        solid.sort(key=lambda k: boxes[k][0][axis])
        active: list[int] = []
        for k in solid:
            offsets, shape = boxes[k]
            start = offsets[axis]
            active = [j for j in active if boxes[j][0][axis] + boxes[j][1][axis] > start]
            for j in active:
                other, extent = boxes[j]
                if all(
                    max(a, b) < min(a + m, b + n)
                    for a, m, b, n in zip(offsets, shape, other, extent, strict=True)
                ):
                    return (
                        f"the chunk {list(shape)} at {list(offsets)} overlaps the chunk "
                        f"{list(extent)} at {list(other)}",
                        (j, k),
                    )
            active.append(k)
    covered, whole = sum(math.prod(s) for _, s in boxes), math.prod(size)
    if covered != whole:
        return f"the stored chunks cover {covered} of its {whole} elements (a shard is missing)", ()
    return None
