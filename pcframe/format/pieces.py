"""A committed version's files as the pieces its manifest checksums: each ``data.bin`` chunk
(in its stripe) and each ``codec.bin`` segment, and their check against the manifest.

What a peer copy streams and checks piece by piece (:mod:`pcframe.distributed.shard_stream`),
and what a replica tier checks of a copy before it publishes it (:func:`verify_files`): a
byte the copy got wrong, or that was wrong in the source already (a memory tier's pages
damaged after the commit), is found before the copy counts, so retention never deletes the
older good copies for it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pcframe.errors import CorruptCheckpoint
from pcframe.format.checksum import checksum_function
from pcframe.format.manifest import Manifest
from pcframe.format.names import CODEC_NAME
from pcframe.format.stripes import stripe_location, stripe_name, stripe_sizes

_READ = 8 << 20  # bytes read at a time by verify_files


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
    """The size of every data file of a version (what a receiver reserves)."""
    sizes = stripe_sizes(manifest.data_size, manifest.chunk_bytes, manifest.stripes)
    files = {stripe_name(s): size for s, size in enumerate(sizes)}
    if manifest.coded:
        files[CODEC_NAME] = manifest.codec_size
    return files


def verify_files(directory: Path, manifest: Manifest) -> None:
    """Check every piece of the version in ``directory`` against ``manifest``'s checksums
    (a version saved without checksums: its files' sizes only).

    Raises:
        CorruptCheckpoint: naming the file and the byte where a piece differs, or a file
            shorter than its manifest says.
    """
    digest = checksum_function(manifest.checksum)
    for name, size in file_sizes(manifest).items():
        try:
            actual = os.stat(directory / name).st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(
                f"{directory / name}: missing (the manifest lists it)"
            ) from None
        if actual < size:
            raise CorruptCheckpoint(f"{directory / name}: {actual} bytes, the manifest says {size}")
    handles: dict[str, int] = {}
    try:
        for piece in pieces(manifest):
            if not piece.checksum:
                continue
            if piece.file not in handles:
                handles[piece.file] = os.open(directory / piece.file, os.O_RDONLY)
            # Read as hashed, _READ bytes at a time: one such buffer held, not the whole piece.
            parts = (
                memoryview(
                    os.pread(handles[piece.file], min(_READ, piece.length - at), piece.offset + at)
                )
                for at in range(0, piece.length, _READ)
            )
            if digest(parts) != piece.checksum:
                raise CorruptCheckpoint(
                    f"{directory / piece.file}: checksum mismatch at byte {piece.offset} "
                    f"({piece.length} bytes)"
                )
    finally:
        for fd in handles.values():
            os.close(fd)
