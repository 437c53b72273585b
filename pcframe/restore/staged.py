"""A rollback read from memory: the chunks of a version the staging pool still holds.

A writer gives each staging buffer back holding the raw ``data.bin`` chunk it wrote, and the
pool remembers which (:class:`~pcframe.save.staging.StagingPool`) until the buffer is used
again. A restore of that version in the same process (a rollback after a loss spike or a
bad batch: the usual reason to restore without restarting) then copies those chunks from
memory instead of reading them from disk. Each is checked against the manifest's checksum
first, the same check a disk read passes, so what is restored is what is on disk.

Only when every raw chunk the restore needs is held and verifies: otherwise the version is
read from disk as before (a mismatch in memory says nothing about the checkpoint, so nothing
is quarantined for it). The live tensors are filled after the whole version verified, as a
restore without spare memory fills them (:mod:`pcframe.state.in_place`), but from memory:
the buffers the copy reads are lent to the restore, so nothing else writes them meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from pcframe.format.layout import Chunk
from pcframe.format.manifest import Manifest


class StagedChunks:
    """The raw chunks of one version held in staging buffers, by chunk index."""

    def __init__(self, buffers: Mapping[int, torch.Tensor]) -> None:
        self._views = {index: memoryview(b.numpy()) for index, b in buffers.items()}

    def __contains__(self, index: object) -> bool:
        return index in self._views

    @classmethod
    def verified(
        cls,
        held: Mapping[int, torch.Tensor] | None,
        chunks: list[Chunk],
        manifest: Manifest,
        checksum: Callable[[list[memoryview]], str],
        run: Callable[[list[Callable[[], None]]], None],
    ) -> StagedChunks | None:
        """The ``chunks`` read from ``held`` buffers, if every one is held and matches its
        checksum in ``manifest`` (checked by ``run``'s threads); otherwise ``None``."""
        if not held or not chunks or any(c.index not in held for c in chunks):
            return None
        staged = cls({c.index: held[c.index] for c in chunks})
        matches: dict[int, bool] = {}

        def check(chunk: Chunk) -> None:
            view = staged._views[chunk.index][: chunk.length]
            matches[chunk.index] = checksum([view]) == manifest.chunks[chunk.index].checksum

        run([lambda c=c: check(c) for c in chunks])
        return staged if all(matches.get(c.index, False) for c in chunks) else None

    def copy_pieces(self, chunk: Chunk, flats: Mapping[int, memoryview]) -> None:
        """Copy the pieces of ``chunk`` that belong to ``flats`` (entry -> its bytes)."""
        source = self._views[chunk.index]
        for piece in chunk.pieces:
            target = flats.get(piece.entry)
            if target is not None:
                end = piece.src_start + piece.nbytes
                target[piece.src_start : end] = source[
                    piece.dst_start : piece.dst_start + piece.nbytes
                ]
