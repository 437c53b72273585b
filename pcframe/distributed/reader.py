"""Read some of the tensors of one shard version, verifying every chunk that is read.

A restore usually needs only part of another rank's shard (its replicated tensors, or the
shard boxes that overlap this rank's new box), so unlike :func:`pcframe.restore.reader.load_version`
this reads only the chunks that hold the wanted tensors. A chunk is the unit of the stored
checksum, so each one is read whole into a scratch buffer, verified, then copied out.

Only raw tensors live in the chunks. A version with coded tensors (compression, deltas
against an older version) is left to the engine's own loader, which knows how to decode it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pcframe.errors import CorruptCheckpoint
from pcframe.format.checksum import checksum_function
from pcframe.format.layout import Chunk
from pcframe.format.manifest import DATA_NAME, Manifest
from pcframe.format.tree import DTYPES
from pcframe.restore.reader import load_version


def read_entries(
    directory: Path, manifest: Manifest, wanted: Iterable[int], threads: int = 4
) -> dict[int, torch.Tensor]:
    """Return ``{entry index: tensor}`` for the wanted manifest entries of ``directory``.

    Raises:
        CorruptCheckpoint: the data file is missing, short, or a chunk's checksum differs.
        OSError: the file cannot be read.
    """
    wanted = set(wanted)
    coded = any(getattr(manifest.entries[i], "codec", "raw") != "raw" for i in wanted)
    if coded or getattr(manifest, "delta", None) is not None:
        loaded = load_version(directory, threads)
        return {i: loaded.tensors[i] for i in wanted}
    data_path = directory / DATA_NAME
    try:
        actual = os.path.getsize(data_path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{data_path}: data file is missing") from None
    if actual != manifest.data_size:
        raise CorruptCheckpoint(
            f"{data_path}: holds {actual} bytes, manifest says {manifest.data_size} (truncated?)"
        )
    out = {
        i: torch.empty(manifest.entries[i].shape, dtype=DTYPES[manifest.entries[i].dtype])
        for i in wanted
    }
    flats = {i: t.reshape(-1).view(torch.uint8) for i, t in out.items()}
    chunks = [c for c in manifest.layout.chunks if any(p.entry in wanted for p in c.pieces)]
    checksum = checksum_function(manifest.checksum)
    fd = os.open(data_path, os.O_RDONLY)
    try:

        def read_chunk(chunk: Chunk) -> None:
            scratch = torch.empty(chunk.length, dtype=torch.uint8)
            view = memoryview(scratch.numpy())
            done = 0
            while done < chunk.length:
                got = os.preadv(fd, [view[done:]], chunk.offset + done)
                if got == 0:
                    raise CorruptCheckpoint(f"{data_path}: ends early at byte {chunk.offset}")
                done += got
            expected = manifest.chunks[chunk.index].checksum
            if manifest.checksum != "none" and checksum([view]) != expected:
                raise CorruptCheckpoint(
                    f"{data_path}: checksum mismatch in chunk {chunk.index} "
                    f"(bytes {chunk.offset}..{chunk.offset + chunk.length})"
                )
            for piece in chunk.pieces:
                if piece.entry in flats:
                    target = flats[piece.entry][piece.src_start : piece.src_start + piece.nbytes]
                    target.copy_(scratch[piece.dst_start : piece.dst_start + piece.nbytes])

        if threads <= 1 or len(chunks) <= 1:
            for chunk in chunks:
                read_chunk(chunk)
        else:
            with ThreadPoolExecutor(min(threads, len(chunks))) as pool:
                for future in [pool.submit(read_chunk, c) for c in chunks]:
                    future.result()
    finally:
        os.close(fd)
    return out
