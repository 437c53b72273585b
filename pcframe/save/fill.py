"""What the copy stage puts into one staging buffer: a data.bin chunk or a coded segment.

The copy thread (and a training thread helping it) calls :class:`Filler` once per buffer;
:mod:`pcframe.save.copy` holds the kernels that do the copying.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pcframe.config import PAGE
from pcframe.format.checksum import format_digest
from pcframe.format.layout import Chunk, PieceTable
from pcframe.save.codec import Segment
from pcframe.save.copy import UNKNOWN_ADDRESS, Copier, host_address
from pcframe.save.write import VersionWrite


class Filler:
    """Fills staging buffers from the tensors of the version being copied.

    Args:
        copier: the copy stage's kernel.
        persist: the persist path (``"mmap"`` hashes while it writes: no fused checksum).
        checksum: the chunk checksum algorithm (recorded when fused into the copy).

    ``stream`` is the CUDA side stream of the version being copied (``None`` for a host
    state): the copy thread sets it, and waits it for the training stream, per version.
    """

    def __init__(self, copier: Copier, persist: str, checksum: str) -> None:
        self.copier, self.persist, self.checksum = copier, persist, checksum
        self.stream: Any = None

    def flat(self, write: VersionWrite, index: int, flats: list[Any]) -> torch.Tensor:
        """Byte view of one source tensor (made contiguous once, only if it is not)."""
        flat = flats[index]
        if flat is None:
            tensor = write.request.tensors[index]
            if tensor.is_conj() or tensor.is_neg():
                # Its bytes are not its values (a lazy conjugate or negation, which cannot be
                # viewed as bytes either): the values, made now.
                tensor = tensor.resolve_conj().resolve_neg()
            if not tensor.is_contiguous():
                if tensor.is_cuda and self.stream is not None:
                    # On the side stream, which waits for the training stream and then
                    # queues the copy of this very tensor: ordered after both.
                    with torch.cuda.stream(self.stream):
                        tensor = tensor.contiguous()
                else:
                    tensor = tensor.contiguous()
            # Two threads may race here: each makes the same bytes, the list keeps one.
            flat = flats[index] = tensor.reshape(-1).view(torch.uint8)
        return flat

    def pieces(self, write: VersionWrite, chunk: Chunk, flats: list[Any]) -> list[Any]:
        """The chunk's pieces bound to this version's tensors (the kernels' input)."""
        return [
            (self.flat(write, p.entry, flats), p.src_start, p.dst_start, p.nbytes)
            for p in chunk.pieces
        ]

    def chunk(
        self, write: VersionWrite, chunk: Chunk, buffer: torch.Tensor, flats: list[Any]
    ) -> None:
        """Stage one data.bin chunk (and, fused into the copy, its pcf64 checksum)."""
        length = _padded(chunk, buffer)
        # Fused only where the writer would hash the staged bytes itself (not on the mmap
        # path, which hashes while it copies into the mapping).
        fused = self.copier.fuses_checksum and self.persist != "mmap"
        table = write.plan.layout.piece_tables[chunk.index]
        sources = self.host_sources(write, table) if self.copier.host_kernel else None
        if sources is not None:
            view = buffer[: chunk.length] if fused else buffer[:length]
            value = self.copier.fill_host(sources, table, view, checksum=fused)
        elif fused:
            pieces = self.pieces(write, chunk, flats)
            value = self.copier.fill(pieces, buffer[: chunk.length], self.stream, checksum=True)
        else:
            self.copier.fill(self.pieces(write, chunk, flats), buffer[:length], self.stream)
        if fused:
            if length > chunk.length:
                buffer[chunk.length : length].zero_()  # O_DIRECT page padding
            write.checksums[chunk.index] = format_digest(self.checksum, value)

    @staticmethod
    def host_sources(write: VersionWrite, table: PieceTable) -> np.ndarray | None:
        """The address of each of a chunk's pieces in host memory, or None if one of its
        tensors is elsewhere or cannot be read as raw bytes (the per-piece path copies it).

        A tensor is looked at when the first chunk holding it is staged (one table per
        version: two threads may race to fill an entry, with the same value)."""
        tensors = write.request.tensors
        if (addresses := write.host_addresses) is None:
            addresses = write.host_addresses = np.full(len(tensors), UNKNOWN_ADDRESS, np.int64)
        bases = addresses[table.entry]
        for i in np.flatnonzero(bases == UNKNOWN_ADDRESS).tolist():
            entry = int(table.entry[i])
            bases[i] = addresses[entry] = host_address(tensors[entry])
        if (bases < 0).any():
            return None
        return bases + table.src_start

    def device_chunk(
        self, write: VersionWrite, chunk: Chunk, buffer: torch.Tensor, *, flats: list[Any]
    ) -> Any:
        """Queue the torch copy of one chunk of a CUDA state; returns its CUDA event."""
        view = buffer[: _padded(chunk, buffer)]
        return self.copier.enqueue(self.pieces(write, chunk, flats), view, self.stream)

    def segment(
        self, write: VersionWrite, segment: Segment, buffer: torch.Tensor, flats: list[Any]
    ) -> None:
        """Stage one segment of a coded tensor: its raw bytes, encoded later by a writer."""
        source = self.flat(write, segment.entry, flats)
        piece = (source, segment.start * segment.itemsize, 0, segment.nbytes)
        self.copier.fill([piece], buffer[: segment.nbytes], self.stream)


def _padded(chunk: Chunk, buffer: torch.Tensor) -> int:
    """Bytes of ``buffer`` a chunk is staged into: whole pages (the file may not be open yet;
    an O_DIRECT write reads the zero tail, a buffered one only ``chunk.length``)."""
    return min(-(-chunk.length // PAGE) * PAGE, len(buffer))
