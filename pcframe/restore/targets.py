"""The live tensors one version is read into (its in-place targets), and where they stand.

:mod:`pcframe.restore.in_place` chooses which live tensors may receive a version's bytes;
this keeps, for one read, which of the version's raw entries they fit, which chunks are read
straight into them (their old bytes kept in spare memory: :mod:`pcframe.restore.backup`) and
which are verified first and read a second time by :meth:`InPlaceTargets.fill` (no spare
memory, or not enough), and the stage their bytes are at (:class:`InPlaceStage`), so that a
failure anywhere before the restore holds puts the old bytes back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from enum import Enum

import torch

from pcframe.format.layout import Chunk
from pcframe.format.records import Manifest
from pcframe.format.tree import DTYPES
from pcframe.restore.backup import LiveBackup, Spare
from pcframe.restore.in_place import byte_span, overlapping
from pcframe.restore.reading import byte_buffer


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
