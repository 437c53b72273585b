"""Byte shuffle in Triton: a [BLOCK, itemsize] tile read row-major, written column-major."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _shuffle_kernel(
    src_ptr, dst_ptr, n, ITEMSIZE: tl.constexpr, BLOCK: tl.constexpr, INVERSE: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, ITEMSIZE)
    packed = i[:, None] * ITEMSIZE + k[None, :]  # element-major position
    planar = k[None, :] * n + i[:, None]  # byte-plane position
    mask = (i < n)[:, None]
    if INVERSE:
        v = tl.load(src_ptr + planar, mask=mask)
        tl.store(dst_ptr + packed, v, mask=mask)
    else:
        v = tl.load(src_ptr + packed, mask=mask)
        tl.store(dst_ptr + planar, v, mask=mask)


def _launch(data: torch.Tensor, itemsize: int, out: torch.Tensor, inverse: bool) -> None:
    if itemsize & (itemsize - 1):
        raise ValueError(f"triton byte shuffle needs a power-of-two itemsize, got {itemsize}")
    n = data.numel() // itemsize
    if n:
        _shuffle_kernel[(triton.cdiv(n, BLOCK),)](
            data, out, n, ITEMSIZE=itemsize, BLOCK=BLOCK, INVERSE=inverse
        )


def shuffle(data: torch.Tensor, itemsize: int, out: torch.Tensor) -> None:
    """Shuffle flat uint8 ``data`` holding elements of ``itemsize`` bytes into ``out``."""
    _launch(data, itemsize, out, inverse=False)


def unshuffle(data: torch.Tensor, itemsize: int, out: torch.Tensor) -> None:
    """Inverse of :func:`shuffle`."""
    _launch(data, itemsize, out, inverse=True)
