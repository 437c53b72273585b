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

import ctypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class _Kept:
    entry: int  # the manifest entry these live bytes belong to
    nbytes: int  # how many live bytes the chunk's read overwrites
    # (live address, spare address, bytes): where they are and where their copies go
    ranges: list[tuple[int, int, int]]


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
    # {version: {chunk index: buffer}}: raw chunks the buffers still hold from the saves
    # (:mod:`pcframe.restore.staged`), and what to call before writing over any buffer.
    staged: Mapping[int, Mapping[int, torch.Tensor]] = field(default_factory=dict)
    written: Callable[[], None] = lambda: None

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

    The copies are libc ``memmove`` calls on addresses worked out by ``reserve``: a state of
    thousands of tensors has thousands of pieces, and a tensor slice and ``copy_`` per piece
    cost microseconds of Python each with the GIL held, so the reading threads took turns
    (3200 tensors: the copies' threads spent 0.48 s in all for 0.25 GiB). ctypes releases
    the GIL for each call. Live targets and spare buffers are contiguous host tensors (the
    reader's targets are; other spare buffers are not used), both referenced by the backup
    (``holding``: the live tensors) for as long as its addresses may be used.
    """

    def __init__(self, spare: Spare, holding: Sequence[torch.Tensor] = ()) -> None:
        spare.backups.append(self)
        self._written = spare.written
        self._holding = holding  # the live tensors the addresses are in: kept alive here
        self.settled = False
        self._spare = [b for b in spare.buffers if b.numel() and b.is_cpu and b.is_contiguous()]
        self._room = sum(b.numel() * b.element_size() for b in self._spare)
        self._buffer = 0  # the spare buffer the next reservation starts in
        self._used = 0  # bytes of that buffer already reserved
        self._chunks: dict[int, list[_Kept]] = {}
        self._kept: list[int] = []  # chunks whose live bytes were copied: maybe overwritten

    def reserve(self, chunk: int, lives: list[tuple[int, int, int]]) -> bool:
        """Room for ``lives`` (``(entry, address, bytes)`` of live memory) of ``chunk``;
        False if it does not fit."""
        need = sum(nbytes for _, _, nbytes in lives)
        if need > self._room:
            return False
        self._room -= need
        self._chunks[chunk] = [
            _Kept(entry, nbytes, self._take(address, nbytes)) for entry, address, nbytes in lives
        ]
        return True

    def _take(self, address: int, nbytes: int) -> list[tuple[int, int, int]]:
        ranges = []
        while nbytes:
            buffer = self._spare[self._buffer]
            size = buffer.numel() * buffer.element_size()
            part = min(nbytes, size - self._used)
            ranges.append((address, buffer.data_ptr() + self._used, part))
            address, nbytes, self._used = address + part, nbytes - part, self._used + part
            if self._used == size:
                self._buffer, self._used = self._buffer + 1, 0
        return ranges

    def keep(self, chunk: int) -> None:
        """Copy ``chunk``'s live bytes into their room (before the chunk is read into them)."""
        memmove = ctypes.memmove
        if not self._kept:  # the first copy: the buffers stop holding the chunks they held
            self._written()
        for kept in self._chunks[chunk]:
            for live, copy, nbytes in kept.ranges:
                memmove(copy, live, nbytes)
        self._kept.append(chunk)  # after the copy: a chunk listed here can be put back

    def put_back(self, keep_entry: Callable[[int], bool] = lambda _: False) -> int:
        """Copy the kept bytes back, except those of entries ``keep_entry`` accepts.

        Returns the bytes put back. Idempotent: the copies stay until the spare goes back.
        """
        memmove, restored = ctypes.memmove, 0
        for chunk in self._kept:
            for kept in self._chunks[chunk]:
                if not keep_entry(kept.entry):
                    for live, copy, nbytes in kept.ranges:
                        memmove(live, copy, nbytes)
                    restored += kept.nbytes
        return restored
