"""Shared data makers and comparisons for the kernel tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcframe.kernels.dispatch import has_triton, triton_interpreting

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

TRITON_ON_CPU = has_triton() and triton_interpreting()
HAS_CUDA = torch.cuda.is_available()

_no_interp = pytest.mark.skipif(
    not TRITON_ON_CPU, reason="Triton interpreter not active (CUDA present or triton missing)"
)
CPU_BACKENDS = ["torch", "numba", pytest.param("triton", marks=_no_interp)]
FAST_BACKENDS = ["numba", pytest.param("triton", marks=_no_interp)]


def make(dtype: torch.dtype, shape: tuple[int, ...], *, seed: int = 0, strided: bool = False):
    """Random tensor with full-range bit patterns for ints and varied magnitudes for floats.

    ``strided=True`` returns a non-contiguous view with the same shape (a transpose of
    a 2-D-or-more buffer, or every other element of a 1-D one).
    """
    g = torch.Generator().manual_seed(seed)
    base_shape = shape
    if strided:
        base_shape = (shape[-1], *shape[:-1]) if len(shape) >= 2 else (max(2 * shape[0], 1),)
    if dtype == torch.bool:
        t = torch.randint(0, 2, base_shape, generator=g).bool()
    elif dtype.is_floating_point:
        mag = torch.exp2(torch.randint(-20, 12, base_shape, generator=g).double())
        t = (torch.randn(base_shape, generator=g, dtype=torch.float64) * mag).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, base_shape, generator=g, dtype=torch.int64).to(dtype)
    if strided:
        t = t.movedim(0, -1) if len(shape) >= 2 else t[::2][: shape[0]]
        assert tuple(t.shape) == tuple(shape) and (t.numel() < 2 or not t.is_contiguous())
    return t


def logical_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's row-major bytes, computed without the package under test."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().copy()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included), plus dtype and shape."""
    return (
        a.dtype == b.dtype
        and tuple(a.shape) == tuple(b.shape)
        and np.array_equal(logical_bytes(a), logical_bytes(b))
    )


def pieces_in_range(entries: list[tuple[torch.Tensor, int]], start: int, length: int) -> list:
    """``(tensor, tensor_offset, buffer_offset, nbytes)`` of one chunk of a flat layout.

    ``entries`` are ``(tensor, offset)`` pairs, each tensor's logical bytes at
    ``[offset, offset + nbytes)``; buffer offsets are relative to ``start``. Written
    independently of the package (the engine's own cutter is ``pcframe.format.layout``).
    """
    stop, out = start + length, []
    for t, off in sorted(entries, key=lambda e: e[1]):
        lo, hi = max(off, start), min(off + t.numel() * t.element_size(), stop)
        if hi > lo:
            out.append((t, lo - off, lo - start, hi - lo))
    return out
