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
them out (a layout is the same from save to save while the state's structure is). The peer
round then streams only the pieces of the copy that do not check against the sender's
manifest (:func:`~pcframe.distributed.shard_stream.receive_version`'s ``prefilled``): the
per-rank parts of the shard (its random number generators' states), and any piece the
shadow got wrong. Nothing is trusted for being a shadow: each piece is checked against the
checksum the sender's manifest holds, as a streamed piece is, so a wrong shadow (the
ranks' states differ, the layout moved, a buffer changed while it was read) costs only the
bytes it got wrong.

The fill runs on a thread of its own while the training goes on, and the optimizer's
``step()`` waits for it (a pre-hook), as it waits for the engine's own snapshot: the
parameters and the optimizer's state do not change before it. A model buffer that changes
in the next forward pass (batch norm's running statistics) may be read while it changes:
its piece then fails its check and is streamed. The fill and the peer round take the
store's ``spare_lock``: a save whose fill would wait for a round (or an earlier fill) does
not fill, and its copy is streamed whole.

What is shadowed: host tensors of replicated state, for one rank this rank backs up (the
store has one spare), once this rank holds a copy of that rank (its layout). Sharded state
(FSDP) has no second holder and is streamed as before; so are tensors on an accelerator
(their bytes would need a device-to-host copy first).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pcframe.format.manifest import Manifest, read_manifest
from pcframe.format.names import CODEC_NAME, MANIFEST_NAME
from pcframe.format.pieces import file_sizes
from pcframe.format.stripes import stripe_location, stripe_name
from pcframe.kernels.dtypes import dtype_name
from pcframe.store.tiers.peer import PeerStore, copy_bytes

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
        active: whether the peer rounds still run (a fill is for a copy to come).
    """

    def __init__(
        self,
        store: PeerStore,
        sources: Sequence[int],
        optimizer: torch.optim.Optimizer,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.store, self.sources, self._active = store, list(sources), active
        self.status = ShadowStatus()
        # One thread, kept: its CPU time shows by name beside the engine's threads.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pcframe-shadow")
        self._pending: Future[None] | None = None
        self._hook: Any = optimizer.register_step_pre_hook(lambda *_: self.wait())

    def start(self, version: int, items: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Start filling the spare for ``version`` of the first rank backed up here that
        owns some of ``items`` (``{src: {item name: this rank's tensor}}``) and of which a
        copy is held (its layout). Returns at once; :meth:`wait` joins the fill."""
        self.wait()
        chosen = self._layout_of(items) if self._active() and self._hook is not None else None
        if chosen is None or not self.store.spare_lock.acquire(blocking=False):
            self.status.skipped += 1
            return
        src, layout = chosen
        try:
            self._pending = self._worker.submit(self._fill, src, version, layout, dict(items[src]))
        except BaseException:
            self.store.spare_lock.release()
            raise

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
        """``(src, folder of its newest copy held here)`` for the first source with both."""
        held = self.store.held()
        for src in self.sources:
            if items.get(src) and held.get(src):
                return src, self.store.path(src, held[src][-1])
        return None

    def _fill(self, src: int, version: int, layout: Path, items: dict[str, torch.Tensor]) -> None:
        try:
            manifest = read_manifest(layout / MANIFEST_NAME)
            places = list(_places(manifest, items))
            sizes = {n: s for n, s in file_sizes(manifest).items() if n != CODEC_NAME}
            spare = self.store.prepare_shadow(sizes, copy_bytes(layout)) if places else None
            if spare is None:  # nothing of it is this rank's to write, or no room
                self.status.skipped += 1
                return
            written = _write(spare, places)
            self.store.mark_shadow(src, version, sizes)
            self.status.fills += 1
            self.status.filled_bytes += written
        except Exception as exc:  # a shadow only saves bytes on the wire: the copy streams
            self.status.skipped += 1
            log.debug("peer tier: no shadow of rank %d's version %d: %s", src, version, exc)
        finally:
            self.store.spare_lock.release()


@dataclass(frozen=True)
class _Place:
    """``length`` bytes of ``tensor`` from byte ``start`` go to ``offset`` of ``file``."""

    tensor: torch.Tensor
    start: int
    file: str
    offset: int
    length: int


def _places(manifest: Manifest, items: Mapping[str, torch.Tensor]) -> Iterator[_Place]:
    """Where each of ``items`` goes in the data files of a copy laid out as ``manifest``:
    its raw entry's bytes, cut where chunks (and so stripes) change. Entries of other
    names, dtypes or shapes (a structure that moved) are left to the stream."""
    for entry in manifest.entries:
        name = item_name(entry.name)
        tensor = items.get(name) if name is not None else None
        if tensor is None or not entry.raw or tensor.device.type != "cpu":
            continue
        if dtype_name(tensor.dtype) != entry.dtype:
            continue
        if tuple(tensor.shape) != tuple(entry.shape) or not tensor.is_contiguous():
            continue
        done = 0
        while done < entry.nbytes:
            at = entry.offset + done
            stripe, offset = stripe_location(at, manifest.chunk_bytes, manifest.stripes)
            length = min(entry.nbytes - done, manifest.chunk_bytes - at % manifest.chunk_bytes)
            yield _Place(tensor, done, stripe_name(stripe), offset, length)
            done += length


def _write(spare: Path, places: list[_Place]) -> int:
    """Write every place into the spare's files; the bytes written."""
    fds: dict[str, int] = {}
    written = 0
    try:
        for place in places:
            if place.file not in fds:
                fds[place.file] = os.open(spare / place.file, os.O_WRONLY | os.O_NOFOLLOW)
            raw = place.tensor.detach().reshape(-1).view(torch.uint8).numpy()
            left = memoryview(raw)[place.start : place.start + place.length]
            offset = place.offset
            while left:  # pwrite may write less than asked
                done = os.pwrite(fds[place.file], left, offset)
                left, offset = left[done:], offset + done
            written += place.length
    finally:
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
    return written


def replicated_items(
    placed: Mapping[str, Any], owners: Mapping[str, int], sources: Sequence[int]
) -> dict[int, dict[str, torch.Tensor]]:
    """``{src: {item name: this rank's tensor}}`` of the replicated items each source owns
    (from :class:`~pcframe.distributed.capture.StateSplitter`'s last split)."""
    out: dict[int, dict[str, torch.Tensor]] = {src: {} for src in sources}
    for name, item in placed.items():
        if item.sharded:
            continue
        owner = owners.get(name)
        if owner in out:
            out[owner][name] = item.local
    return out
