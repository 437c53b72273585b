"""Persistence into a memory-mapped file region: PCcheck's persistent-memory path.

An alternative to ``write`` / O_DIRECT for a DAX-mounted persistent-memory file, or for
the memory tier (tmpfs, ``/dev/shm``): the staged chunk is copied into the mapping with
its checksum computed on the way (one pass), then ``msync`` makes the range durable.

Typical engine use::

    with MappedFile(path, size) as f:
        for offset, chunk in chunks:
            sums.append(persist_chunk_mmap(f, offset, chunk))
        f.flush()  # or flush_mmap(f, offset, len(chunk)) per chunk
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from typing import Any

import numpy as np
import torch

from pcframe.kernels._tensor_bytes import BytesLike, as_uint8_array
from pcframe.kernels.checksum import DEFAULT_ALGORITHM, check_algorithm
from pcframe.kernels.dispatch import backend_module, resolve_backend

__all__ = ["MappedFile", "flush_mmap", "persist_chunk_mmap"]

_PAGE = mmap.PAGESIZE
_MS_SYNC = 0x10 if sys.platform == "darwin" else 4  # <sys/mman.h>; Python's mmap lacks it


class MappedFile:
    """A file mapped read-write and shared, exposed as a uint8 numpy array and tensor.

    The file is grown to ``size`` with ``posix_fallocate`` where available, so running out
    of space raises ``OSError`` here instead of a SIGBUS on a later store.

    Args:
        path: File to map.
        size: Bytes to map; ``None`` maps the whole existing file.
        create: Create the file if missing.
    """

    def __init__(
        self, path: str | os.PathLike[str], size: int | None = None, *, create: bool = True
    ):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        try:
            current = os.fstat(fd).st_size
            if size is None:
                size = current
            elif size > current:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
                else:
                    os.ftruncate(fd, size)
            if size <= 0:
                raise ValueError(f"cannot map an empty region of {path}")
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)  # the mapping keeps the file referenced
        self.path = os.fspath(path)
        self.size = size
        self.array: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8)
        self.tensor: torch.Tensor | None = torch.from_numpy(self.array)

    def flush(self, offset: int = 0, length: int | None = None) -> None:
        """msync the byte range (default: all) to the file."""
        flush_mmap(self, offset, length)

    def close(self) -> None:
        """Unmap; raises ``BufferError`` while views of :attr:`tensor` / :attr:`array` live."""
        if self._mmap is None:
            return
        self.tensor = None
        self.array = None
        self._mmap.close()
        self._mmap = None

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _region_array(region: Any) -> np.ndarray:
    if isinstance(region, MappedFile):
        if region.array is None:
            raise ValueError(f"{region.path} is closed")
        return region.array
    if isinstance(region, mmap.mmap):
        return np.frombuffer(region, dtype=np.uint8)
    if isinstance(region, torch.Tensor):
        if region.dtype != torch.uint8 or region.dim() != 1 or region.device.type != "cpu":
            raise ValueError("region tensor must be a 1-D torch.uint8 CPU tensor")
        return region.numpy()
    if isinstance(region, np.ndarray) and region.dtype == np.uint8 and region.ndim == 1:
        return region
    raise TypeError(
        f"region must be a MappedFile, mmap, or 1-D uint8 tensor/array, got {type(region)}"
    )


def persist_chunk_mmap(
    region: MappedFile | mmap.mmap | torch.Tensor | np.ndarray,
    offset: int,
    chunk: BytesLike,
    *,
    algo: str = DEFAULT_ALGORITHM,
    backend: str = "auto",
    flush: bool = False,
) -> int:
    """Copy ``chunk`` into ``region[offset:]`` and return the chunk's ``algo`` checksum.

    Args:
        region: The mapped region (or any writable 1-D uint8 host buffer).
        offset: Byte offset in ``region``.
        chunk: Host bytes (staged chunk); a tensor contributes its logical bytes.
        algo: ``"pcf64"`` (fused into the copy), ``"crc32c"`` or ``"xxh3_64"``.
        backend: ``"auto"``, ``"numba"`` or ``"torch"`` (this op has no Triton backend:
            its input is already in host memory).
        flush: msync the written range before returning.

    Raises:
        ValueError: Out-of-bounds range, a CUDA chunk, or an unknown algorithm.
    """
    check_algorithm(algo)
    if isinstance(chunk, torch.Tensor) and chunk.device.type != "cpu":
        raise ValueError("persist_chunk_mmap takes host memory; stage the chunk to host first")
    dst = _region_array(region)
    src = as_uint8_array(chunk)
    if offset < 0 or offset + src.size > dst.size:
        raise ValueError(
            f"chunk [{offset}, {offset + src.size}) exceeds the {dst.size}-byte region"
        )
    if not dst.flags.writeable:
        raise ValueError("region is read-only")
    name = resolve_backend(backend, "cpu", op="persist_chunk_mmap", supported=("torch", "numba"))
    value = backend_module("mmap_persist", name).persist(dst, offset, src, algo)
    if flush:
        flush_mmap(region, offset, src.size)
    return value


def _libc_msync() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = ctypes.CDLL(name, use_errno=True).msync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MSYNC = _libc_msync()


def flush_mmap(
    region: MappedFile | mmap.mmap | torch.Tensor | np.ndarray,
    offset: int = 0,
    length: int | None = None,
) -> None:
    """msync(MS_SYNC) the pages holding ``region[offset : offset + length]``.

    Goes through libc via ctypes, which releases the GIL (``mmap.flush`` holds it), so
    several writer threads can flush at once. ``region`` must be (a view of) a mapping.
    """
    arr = _region_array(region)
    length = arr.size - offset if length is None else length
    if length <= 0:
        return
    start = arr.ctypes.data + offset
    page_start = start - start % _PAGE
    span = start + length - page_start
    if _MSYNC is not None:
        if _MSYNC(page_start, span, _MS_SYNC) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"msync failed: {os.strerror(err)}")
        return
    if isinstance(region, MappedFile) and region._mmap is not None:
        base = region.array.ctypes.data  # type: ignore[union-attr]
        region._mmap.flush(page_start - base, span)
        return
    raise OSError("msync is not available on this platform; pass a MappedFile")
