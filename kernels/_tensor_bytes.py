"""Byte-level views of tensors, contiguous or not.

The checkpoint layout stores each tensor's *logical* bytes: its elements in row-major
order, each element's bytes in native (little-endian) order, exactly what
``t.contiguous().view(torch.uint8)`` holds. For contiguous tensors that is a view of
the storage; for strided ones only the requested element range is materialized, so
a large strided tensor cut into many chunks is not copied once per chunk.
"""

from __future__ import annotations

import math

import numpy as np
import torch

BytesLike = bytes | bytearray | memoryview | np.ndarray | torch.Tensor


def tensor_nbytes(t: torch.Tensor) -> int:
    """Number of bytes of ``t``'s logical content."""
    return t.numel() * t.element_size()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of a contiguous tensor's bytes (any dtype, 0-d and empty included)."""
    if not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor; use read_bytes for strided ones")
    return t.detach().reshape(-1).view(torch.uint8)


def _storage_indices(t: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    """Storage element offsets of logical elements ``first .. stop-1`` of a strided tensor."""
    idx = torch.arange(first, stop, dtype=torch.int64, device=t.device)
    offsets = torch.full_like(idx, t.storage_offset())
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        offsets += (idx % size) * stride
        idx = idx.div(size, rounding_mode="floor")
    return offsets


def _storage_flat(t: torch.Tensor) -> torch.Tensor:
    """1-D view over the whole storage of ``t`` in units of its dtype."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.detach().as_strided((n,), (1,), 0)


def _element_span(t: torch.Tensor, offset: int, nbytes: int) -> tuple[int, int]:
    size = t.element_size()
    return offset // size, math.ceil((offset + nbytes) / size)


def read_bytes(t: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """Logical bytes ``[offset, offset + nbytes)`` of ``t`` as a contiguous uint8 tensor.

    A view for contiguous tensors; a fresh tensor holding only the touched elements for
    strided ones.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if t.is_contiguous():
        return byte_view(t)[offset : offset + nbytes]
    first, stop = _element_span(t, offset, nbytes)
    elems = _storage_flat(t)[_storage_indices(t, first, stop)]
    start = offset - first * t.element_size()
    return byte_view(elems)[start : start + nbytes]


def _word_aligned(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.data_ptr() % 8 == 0


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for two 1-D uint8 tensors of one length that do not overlap, in
    8-byte words where both are contiguous and start on a word boundary (the tail and
    anything else byte by byte, queued on the same CUDA stream). torch copies uint8
    elements slower than int64 ones (0.85-0.9x the rate on this x86 VM, one thread, 16 MiB
    at a time), and this copy is the snapshot's: what training waits for."""
    n = src.numel()
    words = n - n % 8 if _word_aligned(dst) and _word_aligned(src) else 0
    if words:
        dst[:words].view(torch.int64).copy_(
            src[:words].view(torch.int64), non_blocking=non_blocking
        )
    if words < n:
        dst[words:].copy_(src[words:], non_blocking=non_blocking)


def write_bytes(t: torch.Tensor, offset: int, data: torch.Tensor) -> None:
    """Overwrite logical bytes ``[offset, offset + len(data))`` of ``t`` with uint8 ``data``."""
    nbytes = data.numel()
    if nbytes == 0:
        return
    if t.is_contiguous():
        byte_view(t)[offset : offset + nbytes].copy_(data)
        return
    if any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride(), strict=True)):
        raise ValueError("cannot write into a tensor whose elements share memory (stride 0)")
    first, stop = _element_span(t, offset, nbytes)
    index = _storage_indices(t, first, stop)
    flat = _storage_flat(t)
    # Whole elements are rewritten, so read them first when the range cuts one in half.
    elems = flat[index]
    start = offset - first * t.element_size()
    byte_view(elems)[start : start + nbytes].copy_(data)
    flat[index] = elems


def as_uint8_array(data: BytesLike) -> np.ndarray:
    """Zero-copy 1-D uint8 numpy view of a CPU bytes-like object or CPU tensor."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"expected host memory, got a {data.device.type} tensor")
        return byte_view(data.contiguous()).numpy()
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def as_uint8_tensor(data: BytesLike) -> torch.Tensor:
    """1-D uint8 tensor over ``data`` (a view when ``data`` is writable host memory)."""
    if isinstance(data, torch.Tensor):
        return byte_view(data.contiguous())
    arr = as_uint8_array(data)
    if not arr.flags.writeable:
        # torch refuses (warns on) read-only buffers; a copy is the only safe option.
        arr = arr.copy()
    return torch.from_numpy(arr)


def address(t: torch.Tensor) -> int:
    """Address of the first byte of ``t`` (valid while ``t`` is alive)."""
    return t.data_ptr()
