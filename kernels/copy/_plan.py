"""Pieces and their lowering to address tables for the kernels.

Planning runs in Python once per call, so it is kept to a few attribute reads per piece
(the engine calls it per chunk with hundreds of small tensors); range checks are
vectorized with numpy. Addresses are read fresh on every call, never cached: a tensor
reallocated between checkpoints must not be copied from its old memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from pcframe.kernels._tensor_bytes import read_bytes, write_bytes


class Piece(NamedTuple):
    """A byte range of one tensor and where it sits in the flat buffer.

    Attributes:
        tensor: The tensor (any dtype, any strides, any device the backend supports).
        tensor_offset: Byte offset into the tensor's logical (row-major) bytes.
        buffer_offset: Byte offset into the flat uint8 buffer.
        nbytes: Number of bytes.
    """

    tensor: torch.Tensor
    tensor_offset: int
    buffer_offset: int
    nbytes: int


PieceLike = Piece | tuple[torch.Tensor, int, int, int]


def as_piece(p: PieceLike) -> Piece:
    """Validate a :class:`Piece` or a ``(tensor, tensor_offset, buffer_offset, nbytes)`` tuple."""
    piece = Piece._make(p)
    if not isinstance(piece.tensor, torch.Tensor):
        raise TypeError(f"piece tensor must be a torch.Tensor, got {type(piece.tensor).__name__}")
    for name, value in zip(Piece._fields[1:], piece[1:], strict=True):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"piece {name} must be a non-negative int, got {value!r}")
    return piece


def check_buffer(buffer: torch.Tensor, what: str) -> None:
    """The flat buffer must be a contiguous 1-D uint8 tensor."""
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"{what} must be a 1-D torch.uint8 tensor")
    if not buffer.is_contiguous():
        raise ValueError(f"{what} must be contiguous")


@dataclass
class Plan:
    """Validated non-empty pieces sorted by buffer offset, as parallel int64 arrays.

    ``tensor_addr[i]`` is the address of piece i's first byte in contiguous memory: the
    tensor itself, or a temporary holding a strided tensor's bytes.
    """

    tensor_addr: np.ndarray
    buffer_offset: np.ndarray
    nbytes: np.ndarray
    pieces: list[Piece]
    temps: list[torch.Tensor | None]
    keepalive: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.nbytes)

    def finish_scatter(self) -> None:
        """Write staged bytes of strided targets back into them (after the kernel ran)."""
        for piece, temp in zip(self.pieces, self.temps, strict=True):
            if temp is not None:
                write_bytes(piece.tensor, int(piece.tensor_offset), temp)


def _fail(pieces: list[Piece], bad: np.ndarray, what: str) -> None:
    p = pieces[int(np.flatnonzero(bad)[0])]
    raise ValueError(f"{what}: piece (tensor_offset={p[1]}, buffer_offset={p[2]}, nbytes={p[3]})")


def make_plan(pieces: Iterable[PieceLike], buffer: torch.Tensor, *, scatter: bool) -> Plan:
    """Validate ``pieces`` against ``buffer`` and lower them to address tables.

    Args:
        pieces: Pieces to copy; zero-length pieces are dropped.
        buffer: The flat uint8 buffer (destination of a gather, source of a scatter).
        scatter: Whether bytes flow from the buffer into the tensors.

    Raises:
        ValueError: A range outside its tensor or the buffer, or pieces overlapping in
            the buffer.
    """
    check_buffer(buffer, "buffer")
    checked = []
    for p in pieces:
        # Fast path for plain-int pieces (negatives are caught below, vectorized);
        # anything unusual goes through as_piece.
        if len(p) == 4 and type(p[1]) is type(p[2]) is type(p[3]) is int:
            if not isinstance(p[0], torch.Tensor):
                p = as_piece(p)  # raises the TypeError
            elif type(p) is not Piece:
                p = Piece._make(p)
        else:
            p = as_piece(p)
        if p[3]:
            checked.append(p)
    if not checked:
        empty = np.zeros(0, dtype=np.int64)
        return Plan(empty, empty, empty, [], [])
    table = np.array([(p[1], p[2], p[3], p[0].nbytes) for p in checked], dtype=np.int64)
    toff, boff, nb, tsize = table.T
    if (table[:, :3] < 0).any():
        _fail(checked, (table[:, :3] < 0).any(axis=1), "negative offset or size")
    if (toff + nb > tsize).any():
        _fail(checked, toff + nb > tsize, "range exceeds its tensor's bytes")
    if (boff + nb > buffer.numel()).any():
        _fail(
            checked,
            boff + nb > buffer.numel(),
            f"range exceeds the buffer's {buffer.numel()} bytes",
        )
    if (np.diff(boff) < 0).any():
        order = np.argsort(boff, kind="stable")
        checked = [checked[i] for i in order]
        toff, boff, nb = toff[order], boff[order], nb[order]
    if (boff[1:] < (boff + nb)[:-1]).any():
        _fail(checked[1:], boff[1:] < (boff + nb)[:-1], "pieces overlap in the buffer")
    temps: list[torch.Tensor | None] = []
    addrs = []
    for p in checked:
        t = p[0]
        if t.is_contiguous():
            temps.append(None)
            addrs.append(t.data_ptr() + p[1])
            continue
        # Strided tensors go through a contiguous temporary holding just this range.
        if scatter:
            temp = torch.empty(p[3], dtype=torch.uint8, device=t.device)
        else:
            temp = read_bytes(t, p[1], p[3]).contiguous()
        temps.append(temp)
        addrs.append(temp.data_ptr())
    return Plan(
        tensor_addr=np.array(addrs, dtype=np.int64),
        buffer_offset=np.ascontiguousarray(boff),
        nbytes=np.ascontiguousarray(nb),
        pieces=checked,
        temps=temps,
        keepalive=[p[0] for p in checked] + [t for t in temps if t is not None],
    )


def gaps(plan: Plan, size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` byte ranges of a ``size``-byte buffer that no piece covers."""
    out = []
    pos = 0
    for start, n in zip(plan.buffer_offset.tolist(), plan.nbytes.tolist(), strict=True):
        if start > pos:
            out.append((pos, start))
        pos = start + n
    if size > pos:
        out.append((pos, size))
    return out
