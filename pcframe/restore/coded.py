"""A version's ``codec.bin`` read back: each segment read, verified, decoded into its tensor.

Coded tensors (format version 2: :mod:`pcframe.save.codec`) are stored segment by segment.
Each segment's payload is read whole, checksummed, then decoded by its codec into its
element range of the entry's tensor (a delta codec from the tensor's value in the base
version). A decoder that fails on verified bytes means hostile or corrupt bytes
(``CorruptCheckpoint``), unless the machine refused it memory (``ENOMEM``, retried like any
I/O error: :func:`~pcframe.restore.chunk_io.out_of_memory`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from pcframe.errors import CorruptCheckpoint, out_of_memory, refused_memory
from pcframe.format.files import open_regular
from pcframe.format.manifest import CODEC_NAME, Manifest, SegmentRecord
from pcframe.restore.chunk_io import check_size, preadv_all


class CodecFile:
    """The ``codec.bin`` of one version: its size checked on construction, open while read."""

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        verify: bool,
        checksum: Callable[[list[memoryview]], object],
    ) -> None:
        self.path = directory / CODEC_NAME
        self.manifest, self.verify, self.checksum = manifest, verify, checksum
        if manifest.coded:
            check_size(self.path, manifest.codec_size)
        self._fd = -1

    def open(self) -> None:
        self._fd = open_regular(self.path)

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def tasks(
        self,
        out: dict[int, torch.Tensor],
        coded: list[int],
        previous: dict[int, torch.Tensor],
    ) -> list[Callable[[], None]]:
        """One task per segment of the ``coded`` entries, decoding into ``out`` (``previous``:
        a delta tensor's value in its base version)."""
        tasks = []
        for i in coded:
            flat = out[i].reshape(-1)
            base = previous.get(i)
            for k, segment in enumerate(self.manifest.segments[i]):
                tasks.append(
                    lambda i=i, k=k, s=segment, f=flat, b=base: self._decode(i, k, s, f, b)
                )
        return tasks

    def _decode(
        self,
        index: int,
        k: int,
        segment: SegmentRecord,
        flat: torch.Tensor,
        base: torch.Tensor | None,
    ) -> None:
        from pcframe.kernels.codecs import get_codec  # on first use, as every codec lookup

        entry = self.manifest.entries[index]
        try:
            payload = memoryview(bytearray(segment.length))
        except MemoryError:
            what = f"segment {k} of {entry.name!r}"
            raise out_of_memory(what, segment.length, self.path) from None
        preadv_all(self._fd, [payload], segment.offset, self.path)
        where = f"{self.path}: tensor {entry.name!r} segment {k}"
        if self.verify and self.checksum([payload]) != segment.checksum:
            raise CorruptCheckpoint(
                f"{where}: checksum mismatch (bytes {segment.offset}.."
                f"{segment.offset + segment.length})"
            )
        span = slice(segment.start, segment.start + segment.count)
        codec = get_codec(entry.codec)
        try:
            codec.decode(
                payload,
                segment.meta,
                flat.dtype,
                (segment.count,),
                previous=base[span] if base is not None else None,
                out=flat[span],
            )
        except OSError:
            raise  # the machine, not the bytes
        except Exception as exc:  # any decoder failure on verified bytes: hostile or corrupt
            if refused_memory(exc):  # ...unless the machine refused the decoder memory
                what = f"decoding segment {k} of {entry.name!r}"
                nbytes = segment.count * flat.element_size()
                raise out_of_memory(what, nbytes, self.path) from None
            raise CorruptCheckpoint(
                f"{where} ({entry.codec}) does not decode: {type(exc).__name__}: {exc}"
            ) from None
