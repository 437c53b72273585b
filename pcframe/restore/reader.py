"""Reading one committed version back: validate, read chunks in parallel, verify, decode.

The one reader of the engine: :func:`load_version` reads a whole version (a restore),
:func:`read_entries` only some of its tensors (a multi-rank restore needs only part of
another rank's shard), :func:`read_entries_into` the same with live tensors verified now
and filled later. Either way only the chunks and segments holding the wanted tensors
are read, and each of them is verified.

Raw chunks (from ``data.bin`` or its stripes) are read with ``preadv`` straight into freshly
allocated tensors (no staging
copy) and checksummed in the same worker thread, a window of ``READ_WINDOW`` bytes at a
time (:func:`~pcframe.restore.chunk_io.read_windows`): each window is hashed right after it
is read, while its bytes are still in the CPU's cache. Bytes only the checksum needs go to
one scratch window per thread. Tensors given as ``targets`` (live tensors of
the same dtype and shape: :mod:`pcframe.state.in_place`) are not written while the
version is verified: their bytes go through the scratch window and are checksummed, and
:attr:`LoadedVersion.fill` reads them a second time, from the page cache, into the targets
once the caller decides to apply. Given ``spare`` memory (the idle staging pool), chunks
whose targets' bytes fit in it are read straight into the targets instead, each after its
targets' bytes were copied there (:mod:`pcframe.restore.live`); a failure puts them back.
Coded tensors (format version 2) are read segment by segment from ``codec.bin``
(:mod:`pcframe.restore.coded`): each payload is checksummed, then decoded into its
element range of a fresh tensor. A delta
tensor first loads its value in the base version (recursively, down to the full version),
and every version on the way is verified like the one asked for.

Nothing is allocated before the manifest passed validation against the real sizes of the
files, so a hostile manifest cannot trigger a giant allocation.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pcframe.errors import CorruptCheckpoint, ManifestError
from pcframe.format.checksum import checksum_function
from pcframe.format.layout import Chunk
from pcframe.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    read_manifest,
)
from pcframe.format.names import VERSION_DIR, version_name
from pcframe.format.tree import decode_tree
from pcframe.restore.chunk_io import (
    DataFiles,
    byte_buffer,
    fresh_tensor,
    preadv_all,
    prefault,
    read_windows,
    reading_pool,
)
from pcframe.restore.coded import CodecFile
from pcframe.restore.live import InPlaceTargets, Spare
from pcframe.restore.staged import StagedChunks


def _nothing(*_: object) -> int:
    return 0


@dataclass
class LoadedVersion:
    manifest: Manifest
    tensors: list[torch.Tensor]  # an in-place target's entry holds the target itself
    # The in-place targets: which were read straight in (already holding the version's
    # bytes, their old ones kept aside) or only verified; ``in_place.unfill()`` after fill.
    in_place: InPlaceTargets
    chain: list[int] = field(default_factory=list)  # versions read, the full one first
    # ``fill(sections)`` makes the in-place targets of those tree sections ("model",
    # "optimizer") hold the version's bytes (reading those not read straight in), puts back
    # the old bytes of the others, and returns the bytes of the former; OSError if the
    # second read fails.
    fill: Callable[[Collection[str]], int] = _nothing
    # Lets go of the files ``fill`` would read; before ``fill``, puts back the old bytes of
    # the chunks read straight into the targets.
    release: Callable[[], object] = _nothing

    @property
    def in_place_bytes(self) -> int:
        """The in-place targets' bytes in the version (what ``fill`` covers)."""
        return self.in_place.in_place_bytes

    def state_tree(self, classes: bool = True) -> Any:
        """The decoded state; ``classes=False`` leaves the classes it names (namedtuples,
        enums) alone, for a check that needs none of them (:func:`decode_tree`)."""
        values: list[Any] = list(self.tensors)
        for index in self.manifest.numpy_tensors:
            values[index] = self.tensors[index].numpy()
        return decode_tree(self.manifest.tree, values, classes=classes)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {e.name: t for e, t in zip(self.manifest.entries, self.tensors, strict=True)}


def load_version(
    directory: str | Path,
    threads: int = 4,
    verify: bool = True,
    targets: Mapping[str, torch.Tensor] | None = None,
    version: int | None = None,
    spare: Spare | None = None,
) -> LoadedVersion:
    """Read and verify one version directory (and, for a delta version, its base chain).

    ``version``: the version this directory is read as (a tier's copy fetched into a scratch
    folder); by default the one its folder name says, if it is named like a version.

    Base versions are looked up next to ``directory`` (``../vNNNNNNNN``). ``targets`` maps
    entry names to contiguous CPU tensors to read those entries into (where dtype and shape
    match the manifest), through the returned version's ``fill`` after verification;
    ``spare``: host buffers free for the duration (the idle staging pool) in which the old
    bytes of targets read straight in are kept, and the targets not to read straight in
    (:class:`~pcframe.restore.live.Spare`).

    Raises:
        ManifestError / CorruptCheckpoint: naming the file and what is wrong with it.
        OSError: when the files cannot be read.
    """
    directory = Path(directory)
    manifest = read_manifest(str(directory / MANIFEST_NAME))
    named = VERSION_DIR.match(directory.name)
    expected = version if version is not None else int(named.group(1)) if named else None
    if expected is not None and expected != manifest.version:
        # A version number restore would count new versions from: it must be the folder's.
        read_as = (
            f"the folder is {directory.name}"
            if named and int(named.group(1)) == expected
            else f"it is read as {version_name(expected)}"
        )
        raise ManifestError(
            f"{directory / MANIFEST_NAME}: 'version' is {manifest.version}, but {read_as}; "
            "the manifest belongs to another version (copied or tampered)"
        )
    reader = _VersionReader(directory, manifest, threads, verify)
    wanted = range(len(manifest.entries))
    tensors, chain = reader.read(wanted, InPlaceTargets(manifest, targets or {}), spare)
    return LoadedVersion(
        manifest,
        [tensors[i] for i in wanted],
        reader.targets,
        chain,
        fill=reader.fill,
        release=reader.release,
    )


def read_entries(
    directory: str | Path,
    manifest: Manifest,
    wanted: Iterable[int],
    threads: int = 4,
    verify: bool = True,
    files: DataFiles | None = None,
) -> dict[int, torch.Tensor]:
    """Return ``{entry index: tensor}`` for the wanted entries of the version in ``directory``.

    ``manifest`` is that version's (validated) manifest. Raw, coded and delta tensors alike;
    a delta tensor's base versions are looked up next to ``directory``. ``files``: that
    version's data files, already open and left open (a reader that holds them from the
    moment it chose the version reads it even after a live writer's retention deleted it).

    Raises:
        ManifestError / CorruptCheckpoint: a file is missing, short, or fails its checksum.
        OSError: when the files cannot be read.
    """
    reader = _VersionReader(Path(directory), manifest, threads, verify, files)
    tensors, _ = reader.read(sorted(set(wanted)))
    return tensors


@dataclass
class InPlaceRead:
    """The targets' half of :func:`read_entries_into`: what
    :func:`~pcframe.state.apply.apply_tree` takes as its ``fill`` (the targets were only
    verified; ``fill`` reads them in)."""

    fill: Callable[[Collection[str]], int]
    unfill: Callable[[], bool]
    release: Callable[[], object]  # lets go of the files (after the fill, or instead of it)


def read_entries_into(
    directory: str | Path,
    manifest: Manifest,
    wanted: Iterable[int],
    targets: Mapping[str, torch.Tensor],
    fills: list[InPlaceRead],
    threads: int = 4,
) -> dict[int, torch.Tensor]:
    """:func:`read_entries`, with ``targets`` (entry name -> live tensor of the same dtype and
    shape) verified now and read into later, by the :class:`InPlaceRead` appended to
    ``fills`` (before anything is read: whatever interrupts, the caller can release it): the
    returned dict holds the target itself for each of them. Nothing is allocated for them,
    and they are not written before ``fill``. The files stay open until ``release``."""
    reader = _VersionReader(Path(directory), manifest, threads, verify=True)
    fills.append(InPlaceRead(reader.fill, reader.unfill, reader.release))
    tensors, _ = reader.read(sorted(set(wanted)), InPlaceTargets(manifest, targets))
    return tensors


class _VersionReader:
    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        threads: int,
        verify: bool,
        files: DataFiles | None = None,
    ) -> None:
        self.directory, self.manifest = directory, manifest
        self.threads, self.verify = threads, verify and manifest.checksum != "none"
        self.checksum = checksum_function(manifest.checksum)
        # Open while reading (and kept for fill); the caller's own files stay open.
        self.data = files if files is not None else DataFiles(directory, manifest)
        self._own_files = files is None
        self.data_path = self.data.paths[0]
        self.codec = CodecFile(directory, manifest, self.verify, self.checksum)
        self.targets = InPlaceTargets(manifest, {})  # none unless read() is given some
        self.staged: StagedChunks | None = None  # raw chunks copied from memory instead

    def read(
        self,
        wanted: Collection[int],
        targets: InPlaceTargets | None = None,
        spare: Spare | None = None,
    ) -> tuple[dict[int, torch.Tensor], list[int]]:
        """Tensors of the wanted entries (by index) and the versions read for them.

        Entries of ``targets`` (all wanted) are verified now and filled by :meth:`fill`
        later, or read straight in where their old bytes fit in ``spare`` (put back if this
        raises).
        """
        entries = self.manifest.entries
        raw = [i for i in wanted if entries[i].raw]
        coded = [i for i in wanted if not entries[i].raw]
        if targets is not None:
            self.targets = targets
        live = self.targets.tensors
        out = {i: live[i] if i in live else fresh_tensor(entries[i], self.data_path) for i in raw}
        tasks: list[Callable[[], None]] = []
        if raw:
            tasks += self._raw_tasks(out, set(raw), spare)
        chain = [self.manifest.version]
        if coded:
            previous, base_chain = self._base_values(coded)
            chain = base_chain + chain
            for i in coded:
                out[i] = fresh_tensor(entries[i], self.codec.path)
            tasks += self.codec.tasks(out, coded, previous)
        kept = False
        try:
            if raw and not self.data.is_open:
                self.data.open()
            if coded:
                self.codec.open()
            self._run(tasks)
            # The fill reads the verified files through the same descriptors: a version
            # deleted meanwhile (another process's retention) is still readable then.
            kept = bool(self.targets.deferred)
        except BaseException:
            self.targets.put_back()  # every task has ended: nothing writes any more
            raise
        finally:
            self.codec.close()
            if not kept and self._own_files:
                self.data.close()
        return out, chain

    def _run(self, tasks: list[Callable[[], None]]) -> None:
        if self.threads <= 1 or len(tasks) <= 1:
            for task in tasks:
                task()
            return
        try:
            pool = reading_pool(self.threads)
            futures = [pool.submit(task) for task in tasks]
        except RuntimeError:  # the interpreter is shutting down: read on this thread
            for task in tasks:
                task()
            return
        # Every task finishes before the files close (or old bytes go back), even when one
        # of them failed or this thread is interrupted, again and again: a task may be
        # reading into live memory. Those not started are cancelled.
        try:
            wait(futures)
        except BaseException:
            for future in futures:
                future.cancel()
            for future in futures:
                while not future.done():
                    try:
                        future.exception()  # returns once it ran (or was cancelled)
                    except BaseException:  # another interrupt (or its cancellation): wait on
                        continue
            raise
        for future in futures:
            future.result()

    # --- data.bin ----------------------------------------------------------------------

    def _raw_tasks(
        self, out: dict[int, torch.Tensor], wanted: set[int], spare: Spare | None
    ) -> list[Callable]:
        live = self.targets.tensors
        flats = {i: byte_buffer(t) for i, t in out.items() if i not in live}
        chunks = [
            c for c in self.manifest.raw_layout.chunks if any(p.entry in wanted for p in c.pieces)
        ]
        held = spare.staged.get(self.manifest.version) if spare is not None else None
        if self.verify:  # only what can be checked, as a disk read is
            self.staged = StagedChunks.verified(
                held, chunks, self.manifest, self.checksum, self._run
            )
        if self.staged is not None:  # verified: the targets are filled from memory too
            self.targets.plan(chunks, None, self.verify)
            copied = [c for c in chunks if any(p.entry in flats for p in c.pieces)]
            return [lambda c=c: self.staged.copy_pieces(c, flats) for c in copied]
        direct = self.targets.plan(chunks, spare, self.verify)
        if not self.verify:  # nothing to check in the targets' bytes before fill reads them
            chunks = [c for c in chunks if any(p.entry in flats for p in c.pieces)]
            return [lambda c=c: self._read_pieces(c, flats) for c in chunks]
        every = {**flats, **self.targets.flats()}
        return [
            (lambda c=c: self._read_straight_in(c, every))
            if c.index in direct
            else (lambda c=c: self._read_chunk(c, flats))
            for c in chunks
        ]

    def _read_straight_in(self, chunk: Chunk, flats: dict[int, memoryview]) -> None:
        self.targets.keep(chunk)  # the old bytes first: they go back if this read fails
        self._read_chunk(chunk, flats)

    def fill(self, sections: Collection[str]) -> int:
        """Make the in-place targets of ``sections`` hold the version (its chunks were
        verified by ``read``); returns their bytes (:meth:`InPlaceTargets.fill`)."""

        def read(chunks: list[Chunk], flats: dict[int, memoryview]) -> None:
            if not self.data.is_open:  # released, or a retry after a failed fill
                self.data.open()
            self._run([lambda c=c: self._read_pieces(c, flats) for c in chunks])

        return self.targets.fill(sections, read)

    def unfill(self) -> bool:
        """After :meth:`fill`: the old bytes back (:meth:`InPlaceTargets.unfill`)."""
        return self.targets.unfill()

    def release(self) -> None:
        """Close the descriptors kept for :meth:`fill`; before a fill, put the old bytes
        back in the targets read straight in (idempotent)."""
        self.data.close()
        self.targets.release()

    def _read_pieces(self, chunk: Chunk, flats: dict[int, memoryview]) -> None:
        """Read only the pieces of ``chunk`` that belong to ``flats`` (no verification):
        pieces that follow each other in the file in one ``preadv``."""
        if self.staged is not None and chunk.index in self.staged:
            return self.staged.copy_pieces(chunk, flats)
        fd, path, located = self.data.locate(chunk)
        self._prefault(chunk, flats)
        buffers: list[memoryview] = []
        start = end = 0
        for piece in chunk.pieces:
            target = flats.get(piece.entry)
            if target is None:
                continue
            if buffers and piece.dst_start != end:
                preadv_all(fd, buffers, located.offset + start, path)
                buffers = []
            if not buffers:
                start = piece.dst_start
            buffers.append(target[piece.src_start : piece.src_start + piece.nbytes])
            end = piece.dst_start + piece.nbytes
        if buffers:
            preadv_all(fd, buffers, located.offset + start, path)

    def _read_chunk(self, chunk: Chunk, flats: dict[int, memoryview]) -> None:
        """Read one whole chunk (other bytes into scratch) and verify its checksum."""
        targets = {p.entry: flats[p.entry] for p in chunk.pieces if p.entry in flats}
        fd, path, located = self.data.locate(chunk)
        self._prefault(chunk, flats)
        windows = read_windows(fd, path, located, targets)
        # The checksum consumes the windows in order, so each is read just before it is hashed.
        if self.checksum(windows) != self.manifest.chunks[chunk.index].checksum:
            raise CorruptCheckpoint(
                f"{path}: checksum mismatch in chunk {chunk.index} "
                f"(bytes {located.offset}..{located.offset + chunk.length})"
            )

    def _prefault(self, chunk: Chunk, flats: dict[int, memoryview]) -> None:
        """Map the pages of the new tensors ``chunk`` is read into (live ones are mapped):
        here, per chunk on the reading threads, not where the tensors are made (one thread,
        before the reads), so that the mapping runs in parallel as the faults did."""
        for piece in chunk.pieces:
            if piece.entry in flats and piece.entry not in self.targets.tensors:
                prefault(flats[piece.entry][piece.src_start : piece.src_start + piece.nbytes])

    def _base_values(self, coded: list[int]) -> tuple[dict[int, torch.Tensor], list[int]]:
        """For a delta version: its delta tensors' values in the base version, by entry."""
        from pcframe.kernels.codecs import get_codec

        entries, link = self.manifest.entries, self.manifest.delta
        needing = [i for i in coded if get_codec(entries[i].codec).needs_previous]
        if not needing:
            return {}, []
        assert link is not None  # parse_body requires a base for delta codecs
        base_dir = self.directory.parent / version_name(link.base)
        if not base_dir.is_dir():
            raise CorruptCheckpoint(
                f"{self.directory}: delta version needs its base version {link.base} "
                f"({base_dir}), which is missing"
            )
        base = read_manifest(str(base_dir / MANIFEST_NAME))
        if base.version != link.base or base.depth != link.depth - 1:
            raise CorruptCheckpoint(
                f"{base_dir}: is version {base.version} at delta depth {base.depth}; version "
                f"{self.manifest.version} expects version {link.base} at depth {link.depth - 1}"
            )
        by_name = {e.name: j for j, e in enumerate(base.entries)}
        wanted = {}
        for i in needing:
            j = by_name.get(entries[i].name)
            if j is None or (base.entries[j].dtype, base.entries[j].shape) != (
                entries[i].dtype,
                entries[i].shape,
            ):
                raise CorruptCheckpoint(
                    f"{base_dir}: has no tensor {entries[i].name!r} {entries[i].dtype}"
                    f"{list(entries[i].shape)} that version {self.manifest.version} is a delta of"
                )
            wanted[i] = j
        reader = _VersionReader(base_dir, base, self.threads, self.verify)
        values, chain = reader.read(sorted(wanted.values()))
        return {i: values[j].reshape(-1) for i, j in wanted.items()}, chain
