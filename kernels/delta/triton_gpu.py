"""XOR delta in Triton: one program per block of bytes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _xor_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, a ^ b, mask=mask)


def xor_bytes(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a XOR b`` for 1-D uint8 tensors of equal length on one device."""
    n = out.numel()
    if n:
        _xor_kernel[(triton.cdiv(n, BLOCK),)](a, b, out, n, BLOCK=BLOCK)
