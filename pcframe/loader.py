"""Reading one committed version back: validate, read chunks in parallel, verify checksums.

Every chunk is read with ``preadv`` straight into freshly allocated tensors (no staging copy)
and checksummed in the same worker thread while the bytes are still in cache. Nothing is
allocated before the manifest passed validation against the real size of the data file, so a
hostile manifest cannot trigger a giant allocation.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pcframe.checksum import checksum_function
from pcframe.errors import CorruptCheckpoint
from pcframe.layout import Chunk
from pcframe.manifest import DATA_NAME, MANIFEST_NAME, Manifest, read_manifest
from pcframe.state import DTYPES, decode_tree

_IOV_MAX = 1024


@dataclass
class LoadedVersion:
    manifest: Manifest
    tensors: list[torch.Tensor]

    def state_tree(self) -> Any:
        values: list[Any] = list(self.tensors)
        for index in self.manifest.numpy_tensors:
            values[index] = self.tensors[index].numpy()
        return decode_tree(self.manifest.tree, values)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {e.name: t for e, t in zip(self.manifest.entries, self.tensors, strict=True)}


def load_version(directory: str | Path, threads: int = 4, verify: bool = True) -> LoadedVersion:
    """Read and verify one version directory.

    Raises:
        ManifestError / CorruptCheckpoint: naming the file and what is wrong with it.
        OSError: when the files cannot be read.
    """
    directory = Path(directory)
    manifest = read_manifest(str(directory / MANIFEST_NAME))
    data_path = directory / DATA_NAME
    try:
        actual = os.path.getsize(data_path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{data_path}: data file is missing") from None
    if actual != manifest.data_size:
        raise CorruptCheckpoint(
            f"{data_path}: holds {actual} bytes, manifest says {manifest.data_size} (truncated?)"
        )
    tensors = [torch.empty(entry.shape, dtype=DTYPES[entry.dtype]) for entry in manifest.entries]
    flats = [t.reshape(-1).view(torch.uint8) for t in tensors]
    checksum = checksum_function(manifest.checksum)
    fd = os.open(data_path, os.O_RDONLY)
    try:

        def read_chunk(chunk: Chunk) -> None:
            buffers, cursor = [], 0
            for piece in chunk.pieces:
                if piece.dst_start > cursor:
                    buffers.append(memoryview(bytearray(piece.dst_start - cursor)))
                target = flats[piece.entry][piece.src_start : piece.src_start + piece.nbytes]
                buffers.append(memoryview(target.numpy()))
                cursor = piece.dst_start + piece.nbytes
            if cursor < chunk.length:
                buffers.append(memoryview(bytearray(chunk.length - cursor)))
            _preadv_all(fd, buffers, chunk.offset, data_path)
            record = manifest.chunks[chunk.index]
            if verify and manifest.checksum != "none" and checksum(buffers) != record.checksum:
                raise CorruptCheckpoint(
                    f"{data_path}: checksum mismatch in chunk {chunk.index} "
                    f"(bytes {chunk.offset}..{chunk.offset + chunk.length})"
                )

        chunks = manifest.layout.chunks
        if threads <= 1 or len(chunks) <= 1:
            for chunk in chunks:
                read_chunk(chunk)
        else:
            with ThreadPoolExecutor(min(threads, len(chunks))) as pool:
                for future in [pool.submit(read_chunk, c) for c in chunks]:
                    future.result()
    finally:
        os.close(fd)
    return LoadedVersion(manifest, tensors)


def _preadv_all(fd: int, buffers: list[memoryview], offset: int, path: Path) -> None:
    """Fill ``buffers`` from consecutive file bytes starting at ``offset`` (handles short reads)."""
    pending = [b for b in buffers if len(b)]
    while pending:
        batch = pending[:_IOV_MAX]
        got = os.preadv(fd, batch, offset)
        if got == 0:
            raise CorruptCheckpoint(f"{path}: unexpected end of file at byte {offset}")
        offset += got
        # Drop fully filled buffers; keep the unread tail of a partially filled one.
        while got and pending:
            head = pending[0]
            if got >= len(head):
                got -= len(head)
                pending.pop(0)
            else:
                pending[0] = head[got:]
                got = 0
