"""One committed version directory sent to another rank, every piece verified as it arrives.

A rank's shard of a version is a pcframe version directory (``manifest.json``, ``data.bin``
or its stripes, ``codec.bin``). :func:`send_version` streams it over a process group as the
manifest, then each ``data.bin`` chunk in layout order (read from its stripe), then each
``codec.bin`` segment; :func:`receive_version` writes the same files, byte for byte, into a
folder of its own. The receiver checks the manifest against the checksum the global record
pins, then each chunk and segment against the manifest's checksum before writing it, so a
copy is exactly the sender's committed files or it is refused: nothing unverified is kept.

The two sides agree on every message from the manifest alone. The receiver checks the
manifest (its envelope, the pinned checksum, the size it made room for) and prepares the
copy's files, then answers *go* or *refuse*: the pieces follow only after a go, so a copy
refused before its stream (a damaged or unexpected manifest, no room left to write it)
leaves nothing in flight. A refusal later (a piece fails its checksum, a write fails) drains
the rest of the stream. A sender that cannot read its files sends a manifest length of -1
(nothing follows) or, after a failed read, zeros for the rest and a failure flag at the end,
so neither side is ever left waiting in a receive, nor gets a message of a size it did not
post (which gloo cannot recover from: it aborts the process). Only a rank that dies or stops
answering breaks a stream (the group's timeout, then an error on the other side).

After its *go* the receiver says which pieces it needs (one byte each), and only those are
streamed. It needs every piece unless it was handed files already filled for this copy
(``prefilled``: a *shadow*, the source's replicated tensors written from this rank's own
identical state, :mod:`pcframe.distributed.shadow`): a chunk the shadow wrote whole whose
bytes already match the manifest's checksum is not sent. The check is the one a streamed
piece gets, so the copy is still exactly the sender's files; a shadow that is wrong anywhere
(the state differed, or the layout moved) only costs the pieces it got wrong. Only the
chunks the shadow wrote are compared (never an older copy's bytes, which differ), and the
caller stops shadowing a rank once one of them differs (``Streamed.missed``): a 32-bit
checksum that happens to match bytes that differ is then a chance taken once, not at every
copy.

A receiver may hand over the files of a copy it was going to delete anyway (``spare``): they
are renamed into the new copy and overwritten, so the copy lands in memory pages the node
already holds. On ``/dev/shm`` that halves the receiver's CPU (measured: a fresh file costs
the kernel a page to allocate and zero for every 4 KiB written, and the old copy's pages to
free). The pieces tile each file exactly (``read_manifest`` refuses a manifest whose chunks or
segments leave a gap), so no old byte is left: the copy is still the sender's files exactly.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pcframe.errors import CheckpointError, CorruptCheckpoint, NotRegularFile
from pcframe.format.checksum import checksum_function
from pcframe.format.envelope import header_crc
from pcframe.format.files import open_regular
from pcframe.format.manifest import MAX_MANIFEST_BYTES, Manifest, manifest_from_bytes
from pcframe.format.names import MANIFEST_NAME
from pcframe.format.pieces import Piece, file_sizes, pieces
from pcframe.store.tiers.peer import SHADOW_MARK, Shadow

_NOTHING = -1  # a manifest length: the sender has no readable version to send
_GO, _REFUSE = 1, 0  # the receiver's answer to a manifest: stream the pieces, or nothing
_MADV_POPULATE_READ = 22  # linux/mman.h (not among Python 3.11's mmap constants)


@dataclass
class Streamed:
    """What one :func:`receive_version` took from where (bytes of its pieces)."""

    sent: int = 0  # streamed by the sender
    prefilled: int = 0  # found right in the prefilled files: not sent
    missed: int = 0  # pieces the shadow wrote that did not check (streamed)


def send_version(directory: Path, dst: int, group: Any) -> int:
    """Stream the committed version in ``directory`` to rank ``dst``; returns the bytes sent.

    Never raises for what it cannot read (the receiver is told and refuses the copy); raises
    only when the stream itself fails (``dst`` gone or not answering).
    """
    try:
        raw = (directory / MANIFEST_NAME).read_bytes()
        manifest = manifest_from_bytes(raw, str(directory / MANIFEST_NAME))
    except Exception:  # unreadable or damaged (OSError, ManifestError): the receiver is told
        _send_int(_NOTHING, dst, group)
        return 0
    _send_int(len(raw), dst, group)
    dist.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), dst, group=group)
    if _receive_int(dst, group) != _GO:  # refused on its manifest: nothing more to send
        return len(raw)
    listed = list(pieces(manifest))
    needed = torch.empty(len(listed), dtype=torch.uint8)
    dist.recv(needed, dst, group=group)
    sent, failed = len(raw), 0
    opened: dict[str, tuple[int, int] | None] = {}  # per file: (descriptor, size)
    zeros = None
    wanted = [piece for piece, need in zip(listed, needed.tolist(), strict=True) if need]
    try:
        for index, piece in enumerate(wanted):  # not a shadow's piece that checked there
            if piece.file not in opened:
                opened[piece.file] = _open(directory / piece.file)
            following = wanted[index + 1] if index + 1 < len(wanted) else None
            if following is not None and following.file == piece.file:
                _read_ahead(opened[piece.file], following)  # read while this one is sent
            if not failed and _send_mapped(opened[piece.file], piece, dst, group):
                sent += piece.length
                continue
            failed = 1  # unreadable, or shorter than its manifest
            if zeros is None:  # zeros keep the stream in step; the flag refuses the copy
                zeros = torch.zeros(max(p.length for p in listed), dtype=torch.uint8)
            dist.send(zeros[: piece.length], dst, group=group)
            sent += piece.length
    finally:
        for handle in opened.values():
            if handle is not None:
                os.close(handle[0])
    _send_int(failed, dst, group)
    return sent


def _open(path: Path) -> tuple[int, int] | None:
    """A descriptor of the regular file ``path`` and its size (a committed version's files
    do not change), or None where it cannot be opened (a link, a folder or a FIFO in its
    place included: refused like a missing file, the stream kept in step)."""
    try:
        fd = open_regular(path)
    except (OSError, NotRegularFile):
        return None
    try:
        return fd, os.fstat(fd).st_size
    except OSError:
        os.close(fd)
        return None


_READ_AHEAD_STEP = 2 << 20  # Linux reads ahead at most a few MiB per WILLNEED call


def _read_ahead(opened: tuple[int, int] | None, piece: Piece) -> None:
    """Have the kernel read ``piece`` of a file while the piece before it is sent: a root's
    files are written past the page cache (O_DIRECT), so after a restart each piece's map
    would otherwise wait for its own read from the disk, piece after piece. One piece
    ahead, so the page cache holds no more of a large shard than that."""
    if opened is None:
        return
    end = piece.offset + piece.length
    for start in range(piece.offset, end, _READ_AHEAD_STEP):
        with contextlib.suppress(OSError):
            length = min(_READ_AHEAD_STEP, end - start)
            os.posix_fadvise(opened[0], start, length, os.POSIX_FADV_WILLNEED)


def _send_mapped(opened: tuple[int, int] | None, piece: Piece, dst: int, group: Any) -> bool:
    """Send ``piece`` of the file ``opened`` (descriptor, size) from a read-only map of it:
    from the page cache, with no copy into a buffer first (a fifth of the sender's CPU).
    False, with nothing sent, where it cannot be read. One piece mapped at a time: a whole
    file mapped would count in the process's resident memory, which the peer tier's budget
    bounds.

    The tensor only goes to ``dist.send``, and a committed version's files are never
    truncated (a version is removed by unlinking its folder, which leaves a map readable), so
    no read of it can fault.
    """
    if opened is None or piece.offset + piece.length > opened[1]:
        return False  # unreadable, or shorter than its manifest
    fd = opened[0]
    try:
        if piece.length == 0:
            dist.send(torch.empty(0, dtype=torch.uint8), dst, group=group)
            return True
        start = piece.offset - piece.offset % mmap.ALLOCATIONGRANULARITY
        length = piece.offset + piece.length - start
        # Private and writable, so that torch takes it without a warning (it warns of, and
        # globally silences, read-only buffers); a write would go to a private copy, never
        # to the file, and nothing writes it.
        memory = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, offset=start)
    except (OSError, ValueError):
        return False
    with contextlib.suppress(OSError):  # map the page cache's pages at once, not by faults
        memory.madvise(_MADV_POPULATE_READ)  # (Linux 5.14; MAP_POPULATE would copy them)
    try:
        data = torch.frombuffer(memory, dtype=torch.uint8)
        dist.send(data[piece.offset - start :], dst, group=group)
        del data
    finally:
        with contextlib.suppress(BufferError):  # a tensor still held: unmapped when freed
            memory.close()
    return True


def receive_version(
    src: int,
    into: Path,
    group: Any,
    expect_crc: str | None = None,
    spare: Path | None = None,
    limit: int | None = None,
    prefilled: Shadow | None = None,
    tally: Streamed | None = None,
) -> Manifest:
    """Receive a version streamed by rank ``src`` into the new folder ``into`` and return
    its manifest; every piece is checked before it is written, the files synced.

    ``expect_crc``: the manifest checksum a global record pins (the copy must be that shard).
    ``spare``: a folder of files the caller no longer needs; the copy's files are made of
    them where there are any (renamed into ``into``: taken even if the copy is refused).
    ``limit``: bytes of files (the manifest included) the caller made room for; a larger
    copy is refused before its pieces are sent.
    ``prefilled``: what ``spare`` holds already filled for this copy (a shadow): its files
    are taken for the files of their names, and its chunks that check are not streamed.
    ``tally``: where to count the bytes streamed and found prefilled.

    Raises:
        CorruptCheckpoint: the sender had nothing readable, the manifest is damaged, is not
            the one pinned or is larger than ``limit``, a piece failed its checksum, or the
            sender failed to read its files; the folder is left for the caller to remove
            (nothing in it is to be trusted).
        OSError: the copy's files could not be made or written here (it is refused; the
            stream was drained or never started).
        RuntimeError: the stream broke (``src`` gone or not answering, or out of step).
    """
    length = _receive_int(src, group)
    if length == _NOTHING:
        raise CorruptCheckpoint(f"rank {src} has no readable copy of this version to send")
    if not 0 < length <= MAX_MANIFEST_BYTES:  # no receive can match what follows: stop
        raise RuntimeError(f"rank {src} announced a manifest of {length} bytes: stream out of step")
    raw = torch.empty(length, dtype=torch.uint8)
    dist.recv(raw, src, group=group)
    path = into / MANIFEST_NAME
    descriptors: dict[str, int] = {}
    shadowed: set[str] = set()  # files taken from the prefilled ones
    files = prefilled.files if prefilled is not None else frozenset()
    try:
        manifest, buffer = _prepare(raw.numpy().tobytes(), path, src, expect_crc, limit)
        spares = _spare_files(spare)
        for name, size in file_sizes(manifest).items():
            fd, reused = _reserve(into / name, size, spares, same_name=name in files)
            descriptors[name] = fd
            if reused == name and name in files:
                shadowed.add(name)
    except (CheckpointError, OSError):  # refused before a piece is sent: none will be
        for fd in descriptors.values():
            os.close(fd)
        _send_int(_REFUSE, src, group)
        raise
    _send_int(_GO, src, group)
    digest = checksum_function(manifest.checksum)
    listed = list(pieces(manifest))
    chunks = prefilled.chunks if prefilled is not None else frozenset()
    candidates = [i in chunks and listed[i].file in shadowed for i in range(len(manifest.chunks))]
    have = _already_right(listed, candidates, descriptors, buffer, digest)
    dist.send(torch.tensor([not h for h in have], dtype=torch.uint8), src, group=group)
    if tally is not None:
        tally.prefilled += sum(p.length for p, h in zip(listed, have, strict=True) if h)
        tally.sent += sum(p.length for p, h in zip(listed, have, strict=True) if not h)
        tally.missed += sum(1 for c, h in zip(candidates, have, strict=False) if c and not h)
    problem = ""
    try:
        for piece, had in zip(listed, have, strict=True):
            if had:
                continue
            view = buffer[: piece.length]
            dist.recv(view, src, group=group)
            if problem:
                continue  # drained, never written: the stream stays in step with the sender
            memory = memoryview(view.numpy())
            if piece.checksum and digest([memory]) != piece.checksum:
                problem = (
                    f"{into / piece.file}: checksum mismatch at byte {piece.offset} of the copy "
                    f"rank {src} sent"
                )
                continue
            try:
                os.pwrite(descriptors[piece.file], memory, piece.offset)
            except OSError as exc:  # no room (a full /dev/shm): refused, the stream drained
                problem = f"{into / piece.file}: cannot write the copy ({exc.strerror})"
        if not problem:
            try:
                for fd in descriptors.values():
                    os.fdatasync(fd)
            except OSError as exc:
                problem = f"{into}: cannot sync the copy ({exc.strerror})"
    finally:
        for fd in descriptors.values():
            os.close(fd)
    if _receive_int(src, group):
        problem = problem or f"rank {src} could not read its files of version {manifest.version}"
    if problem:
        raise CorruptCheckpoint(problem)
    return manifest


def _prepare(
    manifest_bytes: bytes, path: Path, src: int, expect_crc: str | None, limit: int | None
) -> tuple[Manifest, torch.Tensor]:
    """The received manifest checked (before anything is written or allocated from it) and
    written into the new folder, and a buffer for its largest piece.

    Raises:
        CorruptCheckpoint / ManifestError: damaged, not the one pinned, or over ``limit``.
        OSError: the folder or the manifest cannot be written here.
    """
    if expect_crc is not None:
        got = header_crc(manifest_bytes.partition(b"\n")[0], path)
        if got != expect_crc:
            raise CorruptCheckpoint(
                f"{path}: rank {src} sent a manifest other than the one the record pins"
            )
    manifest = manifest_from_bytes(manifest_bytes, str(path))
    size = manifest.stored_bytes + len(manifest_bytes)
    if limit is not None and size > limit:
        raise CorruptCheckpoint(
            f"{path}: rank {src} sent a copy of {size} bytes, more than the {limit} it offered"
        )
    try:
        largest = max((p.length for p in pieces(manifest)), default=0)
        buffer = torch.empty(largest, dtype=torch.uint8)
    except RuntimeError as exc:  # torch's out of memory: this rank's, not the stream's
        raise OSError(f"no memory for a piece of the copy ({exc})") from exc
    path.parent.mkdir(parents=True, exist_ok=False)
    path.write_bytes(manifest_bytes)
    return manifest, buffer


def _already_right(
    listed: list[Piece],
    candidates: list[bool],
    descriptors: dict[str, int],
    buffer: torch.Tensor,
    digest: Any,
) -> list[bool]:
    """Per piece, whether it is a candidate (a chunk a shadow wrote whole, in a file taken
    from it) that its file already holds: its checksum checks, the same check a streamed
    piece gets. A piece that cannot be read is needed."""
    have = [False] * len(listed)
    for index, candidate in enumerate(candidates):
        piece = listed[index]
        if not candidate or not piece.checksum:
            continue
        view = buffer[: piece.length].numpy()
        try:
            got = os.preadv(descriptors[piece.file], [view], piece.offset)
        except OSError:
            continue
        have[index] = got == piece.length and digest([memoryview(view)]) == piece.checksum
    return have


def _spare_files(spare: Path | None) -> list[Path]:
    """The files of ``spare``, largest first (the largest file of a copy is its data)."""
    if spare is None:
        return []
    try:
        found = [
            (entry.stat().st_size, Path(entry.path))
            for entry in os.scandir(spare)
            if entry.name != SHADOW_MARK
        ]
    except OSError:
        return []
    return [path for _, path in sorted(found, key=lambda item: item[0], reverse=True)]


def _reserve(
    path: Path, size: int, spares: list[Path], same_name: bool = False
) -> tuple[int, str | None]:
    """A descriptor of the new file ``path`` of ``size`` bytes and the name of the spare
    file it was made of: with ``same_name``, the spare file of its name (a shadow's file);
    else the largest spare file left (its pages reused; the spare is room made for the
    copy's largest file), else a new file (None)."""
    if same_name:
        same = [old for old in spares if old.name == path.name]
        for old in same:
            spares.remove(old)
        spares[:0] = same
    while spares:
        old = spares.pop(0)
        try:
            os.rename(old, path)
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # gone, or a link: not something to write into
            with contextlib.suppress(OSError):
                os.unlink(path)
            continue
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, size)
            return fd, old.name
        os.close(fd)
        os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    os.ftruncate(fd, size)
    return fd, None


def _send_int(value: int, dst: int, group: Any) -> None:
    dist.send(torch.tensor([value], dtype=torch.int64), dst, group=group)


def _receive_int(src: int, group: Any) -> int:
    box = torch.empty(1, dtype=torch.int64)
    dist.recv(box, src, group=group)
    return int(box.item())
