"""The copy stage's kernel: fill one staging buffer from byte ranges of the source tensors.

``copy_backend="torch"`` uses ``Tensor.copy_`` per piece (on the engine's CUDA side stream for
GPU tensors). The other backends go through :mod:`pcframe.kernels`: ``gather`` (Numba copies
with the GIL released; Triton writes straight into pinned memory), and with the ``pcf64``
checksum ``gather_checksum``, which hashes each piece while it is in cache, so the writer
does not read the chunk a second time.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# (flat uint8 source, byte offset in the source, byte offset in the buffer, bytes)
Piece = tuple[torch.Tensor, int, int, int]


class Copier:
    """Fills staging views for one engine; the backend is fixed at construction."""

    def __init__(self, backend: str, checksum: str) -> None:
        self.backend = backend
        self.kernels = backend != "torch"
        # A kernel backend computes pcf64 in the copy pass; the other algorithms come from
        # their libraries, a second pass in the writer thread.
        self.fuses_checksum = self.kernels and checksum == "pcf64"

    def fill(
        self, pieces: list[Piece], view: torch.Tensor, stream: Any, *, checksum: bool = False
    ) -> int | None:
        """Copy ``pieces`` into ``view`` and zero every byte they do not cover.

        Args:
            pieces: non-overlapping, sorted by buffer offset.
            view: 1-D uint8 host buffer (pinned for GPU sources).
            stream: CUDA side stream that already waits for the training stream, or None.
            checksum: return the pcf64 of all of ``view`` (only if :attr:`fuses_checksum`).

        Returns:
            The pcf64 value when ``checksum`` is set, else ``None``. Either way the bytes are
            in ``view`` when this returns.
        """
        if not self.kernels:
            self._fill_torch(pieces, view, stream)
            return None
        from pcframe.kernels import gather, gather_checksum

        if checksum:
            return gather_checksum(pieces, view, backend=self.backend, stream=stream).result()
        gather(pieces, view, backend=self.backend, zero_fill=True, stream=stream).wait()
        return None

    @staticmethod
    def _fill_torch(pieces: list[Piece], view: torch.Tensor, stream: Any) -> None:
        cursor, cuda = 0, False
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            for source, src_start, dst_start, nbytes in pieces:
                if dst_start > cursor:
                    view[cursor:dst_start].zero_()  # padding: deterministic bytes
                cuda = cuda or source.is_cuda
                view[dst_start : dst_start + nbytes].copy_(
                    source[src_start : src_start + nbytes], non_blocking=True
                )
                cursor = dst_start + nbytes
            if cursor < len(view):
                view[cursor:].zero_()
        if cuda:
            stream.synchronize()
