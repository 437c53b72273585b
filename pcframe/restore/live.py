"""A version read straight into the live tensors, and their old bytes kept until it holds.

:mod:`pcframe.state.in_place` chooses which live tensors may receive a version's bytes.
For one read, :class:`InPlaceTargets` keeps which of the version's raw entries they fit,
which chunks are read straight into them and which are verified first and read a second
time by :meth:`InPlaceTargets.fill` (no spare memory, or not enough), and the stage their
bytes are at (:class:`InPlaceStage`), so that a failure anywhere before the restore holds
puts the old bytes back.

Why spare memory: a restore into live tensors must change nothing if it fails, so without
it the reader verifies every chunk before it writes a byte of a live tensor, and reads the
verified bytes a second time, from the page cache, into the live storage. That second read
is a sixth of a cold restore (576 MiB on 2 cores: 0.06 of 0.37 s). A checkpointer that has
saved owns a staging pool as large as what it stages, resident and idle while it restores
(``restore`` waits for the saves in flight first). With that pool lent as spare memory
(:class:`Spare`), each chunk's live bytes are copied into it (:class:`LiveBackup`) just
before the chunk is read cold straight into the live tensors and verified, so the copy
overlaps the other threads' disk reads and the second read disappears (0.29-0.36 s against
0.38-0.41, measured). If the read fails, or the version does not load, the copies go back:
the objects end as they were.

A fresh allocation instead of the pool would not pay: faulting 576 MiB of new pages in
took 0.26 s here, more than the second read it saves. Chunks beyond the spare memory (a
pool smaller than the state, ``engine.staging_ratio`` < 1) are read twice as before.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from pcframe.format.layout import Chunk
from pcframe.format.manifest import Manifest
from pcframe.format.tree import DTYPES
from pcframe.restore.chunk_io import byte_buffer
from pcframe.state.in_place import byte_span, overlapping


class InPlaceStage(Enum):
    """Where the targets' bytes stand after the version was read and verified."""

    VERIFIED = "verified"  # chunks read straight in hold the new bytes, the others the old
    FILLED = "filled"  # the loaded sections hold the version's bytes: the restore holds
    PUT_BACK = "put back"  # the chunks read straight in hold their old bytes again


class InPlaceTargets:
    """The raw entries of one version that live tensors receive, by entry index."""

    def __init__(self, manifest: Manifest, live: Mapping[str, torch.Tensor]) -> None:
        self.entries = manifest.entries
        self.tensors: dict[int, torch.Tensor] = {}
        for i, entry in enumerate(self.entries):
            target = live.get(entry.name)
            if (
                target is not None
                and entry.raw
                and target.dtype == DTYPES[entry.dtype]
                and tuple(target.shape) == tuple(entry.shape)
                and target.is_contiguous()
                and target.device.type == "cpu"
            ):
                self.tensors[i] = target
        self.deferred: list[Chunk] = []  # verified, then read a second time by fill
        self.in_place_bytes = 0  # the targets' bytes in the version
        self.direct_bytes = 0  # of those, read straight in (after fill: of the sections kept)
        self._direct: dict[int, int] = {}  # entry -> its bytes read straight in
        self.stage = InPlaceStage.VERIFIED
        self._backup: LiveBackup | None = None
        self._refilled = False  # fill began a second read: those old bytes are gone
        self._bytes: dict[int, memoryview] | None = None  # the targets' bytes, by entry

    def flats(self, take: Callable[[int], bool] = lambda _: True) -> dict[int, memoryview]:
        """``{entry: the target's bytes}`` for the entries ``take`` accepts."""
        if self._bytes is None:  # once per read: a view per tensor costs microseconds
            self._bytes = {i: byte_buffer(t) for i, t in self.tensors.items()}
        return {i: view for i, view in self._bytes.items() if take(i)}

    def plan(self, chunks: list[Chunk], spare: Spare | None, verify: bool) -> set[int]:
        """Split the chunks holding targets' bytes: the indices of those read straight in
        (their targets' old bytes fit in ``spare``, none is shared, and the read verifies);
        the rest are :attr:`deferred`."""
        held = [c for c in chunks if any(p.entry in self.tensors for p in c.pieces)]
        self.in_place_bytes = sum(
            p.nbytes for c in held for p in c.pieces if p.entry in self.tensors
        )
        direct: set[int] = set()
        if spare is not None and spare.buffers and verify:  # unverified: never over live
            self._backup = LiveBackup(spare, holding=list(self.tensors.values()))
            addresses = {i: t.data_ptr() for i, t in self.tensors.items()}
            shared = self._sharing_memory(spare.shared)
            for chunk in held:
                if any(p.entry in shared for p in chunk.pieces):
                    continue
                lives = [
                    (p.entry, addresses[p.entry] + p.src_start, p.nbytes)
                    for p in chunk.pieces
                    if p.entry in addresses
                ]
                if self._backup.reserve(chunk.index, lives):
                    direct.add(chunk.index)
                    for entry, _, nbytes in lives:
                        self._direct[entry] = self._direct.get(entry, 0) + nbytes
            self.direct_bytes = sum(self._direct.values())
        self.deferred = [c for c in held if c.index not in direct]
        return direct

    def _sharing_memory(self, names: frozenset[str]) -> set[int]:
        """Entries whose target overlaps another target's memory (tied weights: one tensor
        saved under two names) or is named in ``names`` (another tensor of the objects sees
        it). Read straight in, one thread could keep bytes another has just read over, and
        a put-back would restore those: they are verified first and read twice instead."""
        spans = [(*byte_span(t), i) for i, t in self.tensors.items()]
        named = {i for i in self.tensors if self.entries[i].name in names}
        return overlapping(spans) | named

    def keep(self, chunk: Chunk) -> None:
        """Before ``chunk`` is read straight in: its targets' old bytes go aside."""
        assert self._backup is not None
        self._backup.keep(chunk.index)

    def put_back(self) -> None:
        """The old bytes back in every target read straight in (once nothing writes them)."""
        if self._backup is not None:
            self._backup.put_back()
            self._backup.settled = True
        self.stage = InPlaceStage.PUT_BACK

    def fill(self, sections: Collection[str], read: Callable[[list[Chunk], dict], None]) -> int:
        """The targets of ``sections`` hold the version's bytes once this returns (``read``
        reads the deferred chunks' pieces into the given flats); the targets of other
        sections read straight in get their old bytes back. Returns the bytes of the targets
        of ``sections``."""

        def loads(entry: int) -> bool:
            return self.entries[entry].name.split("/", 1)[0] in sections

        if self._backup is not None:
            self._backup.put_back(keep_entry=loads)
        self.direct_bytes = sum(n for entry, n in self._direct.items() if loads(entry))
        flats = self.flats(loads)
        chunks = [c for c in self.deferred if any(p.entry in flats for p in c.pieces)]
        if chunks:
            self._refilled = True
            read(chunks, flats)
        _written_behind_autograd(self.tensors[i] for i in flats)
        self.stage = InPlaceStage.FILLED
        if self._backup is not None:
            self._backup.settled = True  # from here only unfill (an undo) puts back
        return sum(len(view) for view in flats.values())

    def unfill(self) -> bool:
        """After :meth:`fill`: the old bytes back; False where a second read overwrote some."""
        self.put_back()
        _written_behind_autograd(self.tensors.values())
        self.direct_bytes = 0
        return not self._refilled

    def release(self) -> None:
        """The version is let go: before a fill, the old bytes go back (idempotent)."""
        if self.stage is InPlaceStage.VERIFIED:
            self.put_back()


def _written_behind_autograd(tensors: Iterable[torch.Tensor]) -> None:
    """Count an in-place change on each tensor, as any torch op that writes one does: their
    bytes were written by ``preadv`` or ``memmove``, which autograd does not see, so a graph
    that saved one of them before the restore then refuses ``backward`` instead of mixing
    old activations with restored weights. (Inference tensors keep no count.)"""
    for t in tensors:  # one at a time: torch 2.4 takes no list
        if not t.is_inference():
            torch.autograd.graph.increment_version(t)


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
