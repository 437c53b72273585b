"""Shadows: a peer copy's replicated tensors written from this rank's own state, not sent.

Under data parallelism (DDP) every rank holds the same model and optimizer state, and each
writes a part of it (:func:`~pcframe.distributed.partition.assign_owners`). The rank that
backs up another one (:func:`~pcframe.distributed.nodes.backed_up_by`) therefore already
holds, in its own memory, the bytes of most of the shard it would receive: streaming them
over the network costs both ranks' CPU (the TCP copies, the checksums, the store's pages)
for bytes the receiver has.

So at each save a backing-up rank writes the replicated tensors that one rank it backs up
owns (:class:`ShadowFill`), from its own live state, into its peer store's spare
(:meth:`~pcframe.store.tiers.peer.PeerStore.prepare_shadow`): the files that rank's copy
of this version will be written over, laid out as that rank's newest copy held here lays
them out (a layout is the same from save to save while the state's structure is). It
writes whole chunks only, those holding nothing but such tensors (and the zeros the
engine puts between them), and marks which (:class:`~pcframe.store.tiers.peer.Shadow`).
The peer round then streams every piece but the marked chunks that check against the
sender's manifest (:func:`~pcframe.distributed.shard_stream.receive_version`'s
``prefilled``): the chunk holding the shard's per-rank parts (its random number
generators' states, last in the layout) is streamed, as is anything the shadow got wrong.
Nothing is trusted for being a shadow: each chunk is checked against the checksum the
sender's manifest holds, as a streamed piece is. A shadow that gets a chunk wrong (the
ranks' states differ: not DDP) stops the shadows of that rank for the rest of the job
(:meth:`~pcframe.distributed.replication.PeerReplication.shadows_wanted`), so a 32-bit
checksum is never asked, copy after copy, to tell bytes that differ apart: a chunk it
cannot tell from the sender's would be kept as the copy.

What is shadowed: the model's parameters and the optimizer's state. Model buffers are not:
DDP broadcasts them from rank 0 at each forward pass, then every rank's own batch moves
them (batch norm's running statistics), so they differ between ranks when a version is
saved. The fill runs on a thread of its own while the training goes on, and the
optimizer's ``step()`` waits for it (a pre-hook), as it waits for the engine's own
snapshot: the parameters and the optimizer's state do not change before it. The fill and
the peer round take the store's ``spare_lock``: a save whose fill would wait for a round
does not fill, and its copy is streamed whole (a save waits for the previous fill, which
takes a few milliseconds per 100 MB). Room for the shadow is made as for the copy (the
oldest copy goes at the save instead of at the round; if the round does not come, a save
failed or superseded, it went for nothing).

Not shadowed, and streamed as before: sharded state (FSDP: one holder), coded tensors
(``codecs``, delta versions: their bytes are in ``codec.bin``), tensors on an accelerator
(their bytes would need a device-to-host copy first), the first copy of a rank (no layout
yet), and all but the first rank this rank backs up (the store has one spare).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pcframe.format.layout import Entry
from pcframe.format.manifest import Manifest, read_manifest
from pcframe.format.names import CODEC_NAME, MANIFEST_NAME
from pcframe.format.pieces import file_sizes
from pcframe.format.stripes import stripe_location, stripe_name
from pcframe.kernels.dtypes import dtype_name
from pcframe.store.tiers.peer import PeerStore, Shadow, copy_bytes

log = logging.getLogger("pcframe")

_SUFFIX = "/data"  # a replicated item's entry name: "<item name>/data"


def item_name(entry: str) -> str | None:
    """The state item (:class:`~pcframe.distributed.capture.StateSplitter`'s names,
    ``model/<key>`` or ``optimizer/<index>/<key>``) an entry of a shard's manifest holds,
    or None for an entry of another section (random number generators, user state)."""
    if not entry.endswith(_SUFFIX):
        return None
    path = entry[: -len(_SUFFIX)]
    if path.startswith("model/"):
        return path
    if path.startswith("optimizer/state/"):
        return "optimizer/" + path[len("optimizer/state/") :]
    return None


@dataclass
class ShadowStatus:
    """What the shadows have done on this rank."""

    fills: int = 0  # versions whose shadow was written
    filled_bytes: int = 0  # tensor bytes written into shadows
    skipped: int = 0  # saves that wrote none: the spare was busy, or no layout or room yet


class ShadowFill:
    """Writes, at each save, a shadow of one backed-up rank's copy (module docstring).

    Args:
        store: this rank's peer store (whose spare the shadow is written into).
        sources: the ranks this rank backs up.
        optimizer: the training's optimizer, whose ``step()`` waits for a fill.
        wanted: whether a source's copies are still to be shadowed (the peer rounds run,
            and no shadow of it got a chunk wrong: its state is not this rank's).
    """

    def __init__(
        self,
        store: PeerStore,
        sources: Sequence[int],
        optimizer: torch.optim.Optimizer,
        wanted: Callable[[int], bool] = lambda src: True,
    ) -> None:
        self.store, self.sources, self._wanted = store, list(sources), wanted
        self.status = ShadowStatus()
        # One thread, kept: its CPU time shows by name beside the engine's threads.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pcframe-shadow")
        self._pending: Future[None] | None = None
        self._hook: Any = optimizer.register_step_pre_hook(lambda *_: self.wait())

    def start(self, version: int, items: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Start filling the spare for ``version`` of the first rank backed up here that
        owns some of ``items`` (``{src: {item name: this rank's tensor}}``), is still
        wanted, and of which a copy is held (its layout). Returns at once; :meth:`wait`
        joins the fill. Never raises: a shadow only saves bytes on the wire, and this runs
        inside ``save()``, whose round must be submitted whatever happens here."""
        self.wait()
        try:
            chosen = self._layout_of(items) if self._hook is not None else None
        except Exception as exc:  # the store cannot be listed: its round will say so
            log.debug("peer tier: no shadow of version %d: %s", version, exc)
            chosen = None
        if chosen is None or not self.store.spare_lock.acquire(blocking=False):
            self.status.skipped += 1
            return
        src, layout = chosen
        try:
            self._pending = self._worker.submit(self._fill, src, version, layout, dict(items[src]))
        except Exception as exc:  # the worker cannot start a thread
            self.store.spare_lock.release()
            self.status.skipped += 1
            log.debug("peer tier: no shadow of version %d: %s", version, exc)

    def wait(self) -> None:
        """Until the fill in progress (if any) has ended (it never raises: see _fill)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the fill in progress; no later save fills (idempotent)."""
        self.wait()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._worker.shutdown(wait=True)

    # --- internals ---------------------------------------------------------------------------

    def _layout_of(
        self, items: Mapping[int, Mapping[str, torch.Tensor]]
    ) -> tuple[int, Path] | None:
        """``(src, folder of its newest copy held here)`` for the first wanted source with
        both."""
        held = self.store.held()
        for src in self.sources:
            if items.get(src) and held.get(src) and self._wanted(src):
                return src, self.store.path(src, held[src][-1])
        return None

    def _fill(self, src: int, version: int, layout: Path, items: dict[str, torch.Tensor]) -> None:
        try:
            manifest = read_manifest(layout / MANIFEST_NAME)
            places, chunks = shadow_plan(manifest, items)
            sizes = {n: s for n, s in file_sizes(manifest).items() if n != CODEC_NAME}
            spare = self.store.prepare_shadow(sizes, copy_bytes(layout)) if chunks else None
            if spare is None:  # no chunk is this rank's to write whole, or no room
                self.status.skipped += 1
                return
            written = _write(spare, places)
            self.store.mark_shadow(src, version, Shadow(frozenset(sizes), chunks))
            self.status.fills += 1
            self.status.filled_bytes += written
        except Exception as exc:  # a shadow only saves bytes on the wire: the copy streams
            self.status.skipped += 1
            log.debug("peer tier: no shadow of rank %d's version %d: %s", src, version, exc)
        finally:
            self.store.spare_lock.release()


@dataclass(frozen=True)
class _Span:
    """``length`` bytes at ``offset`` of ``file``: ``tensor``'s from its byte ``start``, or
    zeros (``tensor`` None: the padding between entries, which the engine writes as zeros)."""

    tensor: torch.Tensor | None
    start: int
    file: str
    offset: int
    length: int


def shadow_plan(
    manifest: Manifest, items: Mapping[str, torch.Tensor]
) -> tuple[list[_Span], frozenset[int]]:
    """What a shadow of a copy laid out as ``manifest`` writes from ``items``, and the
    chunks (indices) it writes whole: those every tensor of which is one of ``items`` (of
    the entry's dtype and shape, contiguous, in host memory), padding included. A chunk
    holding anything else (another rank's part of the shard, a tensor of another structure)
    is left to the stream and not written at all."""
    entries = sorted((e for e in manifest.entries if e.raw and e.nbytes), key=lambda e: e.offset)
    places: list[_Span] = []
    chunks: set[int] = set()
    first = 0  # the first entry that may reach into the chunk
    for index, chunk in enumerate(manifest.chunks):
        begin, end = chunk.offset, chunk.offset + chunk.length
        while first < len(entries) and entries[first].offset + entries[first].nbytes <= begin:
            first += 1
        inside = []
        for entry in entries[first:]:
            if entry.offset >= end:
                break
            inside.append((entry, _usable(entry, items)))
        if not inside or any(tensor is None for _, tensor in inside):
            continue
        chunks.add(index)
        at = begin
        for entry, tensor in inside:
            low, high = max(entry.offset, begin), min(entry.offset + entry.nbytes, end)
            if low > at:
                places.append(_place(manifest, None, 0, at, low - at))
            places.append(_place(manifest, tensor, low - entry.offset, low, high - low))
            at = high
        if at < end:
            places.append(_place(manifest, None, 0, at, end - at))
    return places, frozenset(chunks)


def _usable(entry: Entry, items: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """This rank's tensor of ``entry`` where it can stand for the owner's bytes."""
    name = item_name(entry.name)
    tensor = items.get(name) if name is not None else None
    if tensor is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    if dtype_name(tensor.dtype) != entry.dtype or tuple(tensor.shape) != tuple(entry.shape):
        return None
    return tensor


def _place(
    manifest: Manifest, tensor: torch.Tensor | None, start: int, at: int, length: int
) -> _Span:
    """Bytes at ``at`` of the layout, within one chunk: in one stripe file."""
    stripe, offset = stripe_location(at, manifest.chunk_bytes, manifest.stripes)
    return _Span(tensor, start, stripe_name(stripe), offset, length)


_ZEROS = bytes(1 << 20)


def _write(spare: Path, places: list[_Span]) -> int:
    """Write every place into the spare's files; the bytes written."""
    fds: dict[str, int] = {}
    written = 0
    try:
        for place in places:
            if place.file not in fds:
                fds[place.file] = os.open(spare / place.file, os.O_WRONLY | os.O_NOFOLLOW)
            if place.tensor is None:
                left = memoryview(_ZEROS)[: min(place.length, len(_ZEROS))]
                for at in range(place.offset, place.offset + place.length, len(_ZEROS)):
                    _write_all(fds[place.file], left[: place.offset + place.length - at], at)
            else:
                raw = place.tensor.detach().reshape(-1).view(torch.uint8).numpy()
                left = memoryview(raw)[place.start : place.start + place.length]
                _write_all(fds[place.file], left, place.offset)
            written += place.length
    finally:
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
    return written


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:  # pwrite may write less than asked
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def replicated_items(
    placed: Mapping[str, Any],
    owners: Mapping[str, int],
    sources: Sequence[int],
    parameters: Collection[str],
) -> dict[int, dict[str, torch.Tensor]]:
    """``{src: {item name: this rank's tensor}}`` of the replicated items each source owns
    (from :class:`~pcframe.distributed.capture.StateSplitter`'s last split): the model's
    ``parameters`` (item names) and the optimizer's state. Model buffers are left out: DDP
    broadcasts them from rank 0 at each forward pass, then every rank's batch moves them
    (batch norm's statistics), so they differ between ranks when a version is saved."""
    out: dict[int, dict[str, torch.Tensor]] = {src: {} for src in sources}
    for name, item in placed.items():
        if item.sharded or (name.startswith("model/") and name not in parameters):
            continue
        owner = owners.get(name)
        if owner in out:
            out[owner][name] = item.local
    return out
