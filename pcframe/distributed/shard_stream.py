"""One committed version directory sent to another rank, every piece verified as it arrives.

A rank's shard of a version is a pcframe version directory (``manifest.json``, ``data.bin``
or its stripes, ``codec.bin``). :func:`send_version` streams it over a process group as the
manifest, then each ``data.bin`` chunk in layout order (read from its stripe), then each
``codec.bin`` segment; :func:`receive_version` writes the same files, byte for byte, into a
folder of its own. The receiver checks the manifest against the checksum the global record
pins, then each chunk and segment against the manifest's checksum before writing it, so a
copy is exactly the sender's committed files or it is refused: nothing unverified is kept.

The two sides agree on every message from the manifest alone. A sender that cannot read its
files sends a manifest length of -1 (nothing follows) or, after a failed read, zeros for the
rest and a failure flag at the end, so the receiver is never left waiting in a receive and
refuses the copy. Only a rank that dies or stops answering breaks a stream (the group's
timeout, then an error on the other side).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pcframe.errors import CorruptCheckpoint
from pcframe.format.checksum import checksum_function
from pcframe.format.envelope import header_crc
from pcframe.format.files import open_regular
from pcframe.format.manifest import Manifest, read_manifest
from pcframe.format.names import CODEC_NAME, MANIFEST_NAME
from pcframe.format.stripes import stripe_location, stripe_name, stripe_sizes
from pcframe.restore.chunk_io import preadv_all

_NOTHING = -1  # a manifest length: the sender has no readable version to send


@dataclass(frozen=True)
class Piece:
    """One verified unit of a version's files: ``length`` bytes at ``offset`` of ``file``."""

    file: str
    offset: int
    length: int
    checksum: str  # the manifest's hex digest ("" when the version was saved unchecked)


def pieces(manifest: Manifest) -> Iterator[Piece]:
    """Every data chunk (in its stripe) and codec segment of a version, in stream order."""
    for chunk in manifest.chunks:
        stripe, offset = stripe_location(chunk.offset, manifest.chunk_bytes, manifest.stripes)
        yield Piece(stripe_name(stripe), offset, chunk.length, chunk.checksum)
    segments = sorted(
        (segment for entry in manifest.segments.values() for segment in entry),
        key=lambda segment: segment.offset,
    )
    for segment in segments:
        yield Piece(CODEC_NAME, segment.offset, segment.length, segment.checksum)


def file_sizes(manifest: Manifest) -> dict[str, int]:
    """The size of every data file of a version (what the receiver reserves)."""
    sizes = stripe_sizes(manifest.data_size, manifest.chunk_bytes, manifest.stripes)
    files = {stripe_name(s): size for s, size in enumerate(sizes)}
    if manifest.coded:
        files[CODEC_NAME] = manifest.codec_size
    return files


def send_version(directory: Path, dst: int, group: Any) -> int:
    """Stream the committed version in ``directory`` to rank ``dst``; returns the bytes sent.

    Never raises for what it cannot read (the receiver is told and refuses the copy); raises
    only when the stream itself fails (``dst`` gone or not answering).
    """
    try:
        raw = (directory / MANIFEST_NAME).read_bytes()
        manifest = read_manifest(str(directory / MANIFEST_NAME))
    except Exception:  # unreadable or damaged (OSError, ManifestError): the receiver is told
        _send_int(_NOTHING, dst, group)
        return 0
    _send_int(len(raw), dst, group)
    dist.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), dst, group=group)
    sent, failed = len(raw), 0
    descriptors: dict[str, int] = {}
    buffer = torch.empty(max((p.length for p in pieces(manifest)), default=0), dtype=torch.uint8)
    try:
        for piece in pieces(manifest):
            view = buffer[: piece.length]
            if not failed:
                try:
                    fd = descriptors.get(piece.file)
                    if fd is None:
                        fd = descriptors[piece.file] = open_regular(directory / piece.file)
                    preadv_all(fd, [memoryview(view.numpy())], piece.offset, directory / piece.file)
                except (OSError, CorruptCheckpoint):  # unreadable, or shorter than its manifest
                    failed = 1
            if failed:
                view.zero_()
            dist.send(view, dst, group=group)
            sent += piece.length
    finally:
        for fd in descriptors.values():
            os.close(fd)
    _send_int(failed, dst, group)
    return sent


def receive_version(src: int, into: Path, group: Any, expect_crc: str | None = None) -> Manifest:
    """Receive a version streamed by rank ``src`` into the new folder ``into`` and return
    its manifest; every piece is checked before it is written, the files synced.

    ``expect_crc``: the manifest checksum a global record pins (the copy must be that shard).

    Raises:
        CorruptCheckpoint: the sender had nothing readable, the manifest is not the one
            pinned, a piece failed its checksum, or the sender failed to read its files; the
            folder is left for the caller to remove (nothing in it is to be trusted).
        RuntimeError: the stream broke (``src`` gone or not answering).
    """
    length = _receive_int(src, group)
    if length == _NOTHING:
        raise CorruptCheckpoint(f"rank {src} has no readable copy of this version to send")
    raw = torch.empty(length, dtype=torch.uint8)
    dist.recv(raw, src, group=group)
    manifest_bytes = raw.numpy().tobytes()
    into.mkdir(parents=True, exist_ok=False)
    path = into / MANIFEST_NAME
    problem = ""
    if expect_crc is not None:
        got = header_crc(manifest_bytes.partition(b"\n")[0], path)
        if got != expect_crc:
            problem = f"{path}: rank {src} sent a manifest other than the one the record pins"
    path.write_bytes(manifest_bytes)
    manifest = read_manifest(str(path))  # validated before anything is allocated from it
    digest = checksum_function(manifest.checksum)
    descriptors = {name: _reserve(into / name, size) for name, size in file_sizes(manifest).items()}
    buffer = torch.empty(max((p.length for p in pieces(manifest)), default=0), dtype=torch.uint8)
    try:
        for piece in pieces(manifest):
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
            for fd in descriptors.values():
                os.fdatasync(fd)
    finally:
        for fd in descriptors.values():
            os.close(fd)
    if _receive_int(src, group):
        problem = problem or f"rank {src} could not read its files of version {manifest.version}"
    if problem:
        raise CorruptCheckpoint(problem)
    return manifest


def _reserve(path: Path, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    os.ftruncate(fd, size)
    return fd


def _send_int(value: int, dst: int, group: Any) -> None:
    dist.send(torch.tensor([value], dtype=torch.int64), dst, group=group)


def _receive_int(src: int, group: Any) -> int:
    box = torch.empty(1, dtype=torch.int64)
    dist.recv(box, src, group=group)
    return int(box.item())
