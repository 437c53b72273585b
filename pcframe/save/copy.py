"""The copy stage's kernel: fill one staging buffer from byte ranges of the source tensors.

``copy_backend="torch"`` runs the kernels' torch reference (``Tensor.copy_`` per piece, on
the engine's CUDA side stream for GPU tensors). The other backends go through
:mod:`pcframe.kernels`: ``gather`` (Numba copies with the GIL released; Triton writes straight
into pinned memory), and with the ``pcf64`` checksum ``gather_checksum``, which hashes each
piece while it is in cache, so the writer does not read the chunk a second time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import torch

import pcframe.kernels as kernels
from pcframe.kernels.copy import PieceLike, make_plan, reference


class SharedChunks:
    """The host chunks of one version still to be staged, taken one at a time by any thread.

    The copy thread works through them; a training thread that would otherwise wait for the
    copy takes chunks too.
    """

    def __init__(self, write: Any, chunks: Sequence[Any], flats: list[Any]) -> None:
        self.write, self.flats = write, flats
        self._chunks = iter(chunks)
        self._returned: list[Any] = []  # taken, then given back unstaged
        self._busy = 0
        self._closed = False
        self._cond = threading.Condition()

    def take(self) -> Any | None:
        """The next chunk to stage (the caller must call :meth:`done`), or None at the end."""
        with self._cond:
            if self._closed:
                return None
            chunk = self._returned.pop() if self._returned else next(self._chunks, None)
            if chunk is not None:
                self._busy += 1
            return chunk

    def done(self, unstaged: Any | None = None) -> None:
        """A taken chunk is staged, or (``unstaged``) given back for another thread."""
        with self._cond:
            self._busy -= 1
            if unstaged is not None:
                self._returned.append(unstaged)
            self._cond.notify_all()

    def finish(self) -> list[Any]:
        """No more chunks for anyone; once every taken chunk is staged or given back,
        returns the chunks given back after the copy thread stopped taking."""
        with self._cond:
            self._closed = True
            while self._busy:
                self._cond.wait()
            returned, self._returned = self._returned, []
            return returned


class Copier:
    """Fills staging views for one engine; the backend is fixed at construction."""

    def __init__(self, backend: str, checksum: str) -> None:
        self.backend = backend
        self.kernels = backend != "torch"
        # A kernel backend computes pcf64 in the copy pass; the other algorithms come from
        # their libraries, a second pass in the writer thread.
        self.fuses_checksum = self.kernels and checksum == "pcf64"
        # Whether two threads may fill buffers at once (the training thread helping the copy
        # thread): Triton kernels of host tensors run in its interpreter, which is not
        # thread-safe.
        self.shareable = backend in ("torch", "numba")

    def fill(
        self, pieces: list[PieceLike], view: torch.Tensor, stream: Any, *, checksum: bool = False
    ) -> int | None:
        """Copy ``pieces`` into ``view`` and zero every byte they do not cover.

        Args:
            pieces: ``(flat uint8 source, byte offset in it, byte offset in view, bytes)``,
                non-overlapping, sorted by buffer offset.
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
        if checksum:
            done = kernels.gather_checksum(pieces, view, backend=self.backend, stream=stream)
            return done.result()
        kernels.gather(pieces, view, backend=self.backend, zero_fill=True, stream=stream).wait()
        return None

    @staticmethod
    def _fill_torch(pieces: list[PieceLike], view: torch.Tensor, stream: Any) -> None:
        # The kernels' torch reference, on the engine's side stream as it is (it already
        # waits for the training stream): no second wait, unlike the kernels' public gather.
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            reference.gather(make_plan(pieces, view, scatter=False), view, zero_fill=True)
        if stream is not None and any(source.is_cuda for source, *_ in pieces):
            stream.synchronize()
