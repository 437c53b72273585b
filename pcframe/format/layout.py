"""Where every tensor lives in a version's data file, and how the file is cut into chunks.

A :class:`Layout` is built once per distinct set of (name, dtype, shape) and reused for every
later save of the same state, so the hot path does no per-save planning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from pcframe.kernels.dtypes import dtype_name


@dataclass(frozen=True)
class Entry:
    """One tensor's slot in the data file, or a coded tensor (stored in ``codec.bin``).

    ``nbytes`` is always the tensor's logical size; ``offset`` only means something for raw
    entries (coded ones keep 0 and are left out of the chunks).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    codec: str = "raw"

    @property
    def raw(self) -> bool:
        return self.codec == "raw"


@dataclass(frozen=True)
class ChunkPiece:
    """A byte range of one entry's tensor that falls inside one chunk.

    Bound to the tensors of one save it becomes a :class:`pcframe.kernels.Piece` (the copy
    kernels' input): ``(tensors[entry], src_start, dst_start, nbytes)``.
    """

    entry: int  # index into Layout.entries
    src_start: int  # byte offset inside the tensor
    dst_start: int  # byte offset inside the chunk
    nbytes: int


class PieceTable(NamedTuple):
    """One chunk's pieces as int64 arrays, one row per piece (``ChunkPiece``'s fields): what
    a kernel that copies a whole chunk in one call reads, with no Python per piece."""

    entry: np.ndarray
    src_start: np.ndarray
    dst_start: np.ndarray
    nbytes: np.ndarray


@dataclass(frozen=True)
class Chunk:
    index: int
    offset: int  # byte offset inside the data file
    length: int  # bytes of file content (tensor bytes plus alignment padding)
    pieces: tuple[ChunkPiece, ...]


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]
    data_size: int
    chunk_bytes: int

    @staticmethod
    def signature(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple:
        """What the layout depends on, plus what the capture's checks read: a tensor that
        turns sparse or moves to the meta device with the same shape is checked again."""
        # torch.Size and torch.device compare as the tuple and the device they hold; no
        # conversion per tensor (a save of thousands of tensors computes this each time).
        return tuple((name, t.dtype, t.shape, t.layout, t.device) for name, t in tensors)

    @classmethod
    def build(
        cls, tensors: Sequence[tuple[str, torch.Tensor]], chunk_bytes: int, align: int
    ) -> Layout:
        entries, offset = [], 0
        for name, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            offset = _align(offset, align)
            entries.append(
                Entry(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes)
            )
            offset += nbytes
        return cls(tuple(entries), offset, chunk_bytes)

    @classmethod
    def from_entries(cls, entries: Sequence[Entry], data_size: int, chunk_bytes: int) -> Layout:
        return cls(tuple(entries), data_size, chunk_bytes)

    @property
    def num_chunks(self) -> int:
        return -(-self.data_size // self.chunk_bytes)

    @cached_property
    def chunks(self) -> tuple[Chunk, ...]:
        """Chunks with the tensor pieces each one holds; bytes between pieces are padding."""
        raw = (i for i, e in enumerate(self.entries) if e.raw)
        order = sorted(raw, key=lambda i: self.entries[i].offset)
        chunks, cursor = [], 0
        for index in range(self.num_chunks):
            start = index * self.chunk_bytes
            end = min(start + self.chunk_bytes, self.data_size)
            pieces = []
            # Entries are sorted by offset, so a moving cursor visits each one O(1) times.
            while cursor < len(order) and self._end(order[cursor]) <= start:
                cursor += 1
            probe = cursor
            while probe < len(order) and self.entries[order[probe]].offset < end:
                entry = self.entries[order[probe]]
                lo, hi = max(entry.offset, start), min(entry.offset + entry.nbytes, end)
                if hi > lo:
                    pieces.append(ChunkPiece(order[probe], lo - entry.offset, lo - start, hi - lo))
                probe += 1
            chunks.append(Chunk(index, start, end - start, tuple(pieces)))
        return tuple(chunks)

    @cached_property
    def piece_tables(self) -> tuple[PieceTable, ...]:
        """:attr:`chunks` as one :class:`PieceTable` per chunk (built once per layout)."""
        tables = []
        for chunk in self.chunks:
            rows = np.array(
                [(p.entry, p.src_start, p.dst_start, p.nbytes) for p in chunk.pieces],
                dtype=np.int64,
            ).reshape(-1, 4)
            tables.append(PieceTable(*(np.ascontiguousarray(col) for col in rows.T)))
        return tuple(tables)

    def _end(self, i: int) -> int:
        return self.entries[i].offset + self.entries[i].nbytes
