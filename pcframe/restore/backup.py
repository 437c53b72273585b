"""The live bytes a restore overwrites, kept in spare host memory until the restore holds.

A restore into live tensors must change nothing if it fails, so by default the reader
verifies every chunk before it writes a byte of a live tensor, and reads the verified
bytes a second time, from the page cache, into the live storage (:mod:`pcframe.restore.
in_place`). That second read is a sixth of a cold restore (576 MiB on 2 cores: 0.06 of
0.37 s). A checkpointer that has saved owns a staging pool as large as what it stages,
resident and idle while it restores (``restore`` waits for the saves in flight first). With
that pool lent as spare memory, each chunk's live bytes are copied into it just before the
chunk is read cold straight into the live tensors and verified, so the copy overlaps the
other threads' disk reads and the second read disappears (0.29-0.36 s against 0.38-0.41,
measured). If the read fails, or the version does not load, the copies go back: the objects
end as they were.

A fresh allocation instead of the pool would not pay: faulting 576 MiB of new pages in
took 0.26 s here, more than the second read it saves. Chunks beyond the spare memory (a
pool smaller than the state, ``engine.staging_ratio`` < 1) are read twice as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pcframe.kernels._tensor_bytes import copy_bytes


@dataclass
class _Kept:
    entry: int  # the manifest entry these live bytes belong to
    live: torch.Tensor  # 1-D uint8 view of the live bytes the chunk's read overwrites
    copies: list[torch.Tensor]  # slices of the spare buffers holding them, in order


@dataclass
class Spare:
    """What one restore may read straight over: host ``buffers`` lent for the old bytes
    (the idle staging pool), and the targets it must not (``shared``: names of live tensors
    whose memory another tensor of the objects also covers, an alias a load would write or
    snapshot on its own). Every :class:`LiveBackup` made from it is listed, so that a restore
    leaving by an exception anywhere (an interrupt between the read and the apply) puts
    back what is not settled yet: :meth:`put_back_unsettled`."""

    buffers: Sequence[torch.Tensor] = ()
    shared: frozenset[str] = frozenset()
    backups: list[LiveBackup] = field(default_factory=list)

    def put_back_unsettled(self) -> None:
        for backup in reversed(self.backups):  # the newest first: older ones were settled
            if not backup.settled:
                backup.put_back()
                backup.settled = True


class LiveBackup:
    """Room in spare buffers for the live bytes of some chunks, and putting them back.

    ``reserve`` (one thread, before reading) gives a chunk room; ``keep`` (the chunk's
    reading thread, before it reads) copies the live bytes; ``put_back`` (once no chunk is
    being read) copies them back. ``settled``: the restore holds (a fill kept the bytes) or
    they were put back for good (a failed read; the spare buffers may then be reused by the
    next version's backup): only an explicit undo puts them back any more.
    """

    def __init__(self, spare: Spare) -> None:
        spare.backups.append(self)
        self.settled = False
        self._spare = [b for b in spare.buffers if b.numel()]
        self._room = sum(b.numel() for b in self._spare)
        self._buffer = 0  # the spare buffer the next reservation starts in
        self._used = 0  # bytes of that buffer already reserved
        self._chunks: dict[int, list[_Kept]] = {}
        self._kept: list[int] = []  # chunks whose live bytes were copied: maybe overwritten

    def reserve(self, chunk: int, lives: list[tuple[int, torch.Tensor]]) -> bool:
        """Room for ``lives`` (``(entry, uint8 view)``) of ``chunk``; False if it does not fit."""
        need = sum(live.numel() for _, live in lives)
        if need > self._room:
            return False
        self._room -= need
        self._chunks[chunk] = [_Kept(e, live, self._take(live.numel())) for e, live in lives]
        return True

    def _take(self, nbytes: int) -> list[torch.Tensor]:
        slices = []
        while nbytes:
            buffer = self._spare[self._buffer]
            part = min(nbytes, buffer.numel() - self._used)
            slices.append(buffer[self._used : self._used + part])
            nbytes -= part
            self._used += part
            if self._used == buffer.numel():
                self._buffer, self._used = self._buffer + 1, 0
        return slices

    def keep(self, chunk: int) -> None:
        """Copy ``chunk``'s live bytes into their room (before the chunk is read into them)."""
        for kept in self._chunks[chunk]:
            _copy_between(kept.live, kept.copies, to_copies=True)
        self._kept.append(chunk)  # after the copy: a chunk listed here can be put back

    def put_back(self, keep_entry: Callable[[int], bool] = lambda _: False) -> int:
        """Copy the kept bytes back, except those of entries ``keep_entry`` accepts.

        Returns the bytes put back. Idempotent: the copies stay until the spare goes back.
        """
        restored = 0
        for chunk in self._kept:
            for kept in self._chunks[chunk]:
                if not keep_entry(kept.entry):
                    _copy_between(kept.live, kept.copies, to_copies=False)
                    restored += kept.live.numel()
        return restored


def _copy_between(live: torch.Tensor, copies: list[torch.Tensor], *, to_copies: bool) -> None:
    at = 0
    for part in copies:
        n = part.numel()
        if to_copies:
            copy_bytes(part, live[at : at + n])
        else:
            copy_bytes(live[at : at + n], part)
        at += n
