"""pcf64 in Triton: one program per block of words, partial sums added on the host.

``pcf64_terms`` is shared with the fused gather kernel in ``copy/triton_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from pcframe.kernels.checksum.reference import pcf64_finalize

_KEY_STEP = tl.constexpr(0x9E3779B97F4A7C15)
_LO32 = tl.constexpr(0xFFFFFFFF)
BLOCK_WORDS = 512


@triton.jit
def pcf64_terms(words, word_index):
    """pcf64 terms c_j of uint64 ``words`` at global word indices ``word_index`` (uint64)."""
    x = words ^ ((word_index + 1) * _KEY_STEP)
    return (x & _LO32) * (x >> 32) + x


@triton.jit
def load_words(base, pos, mask):
    """Bytes at ``base + pos`` ([W, 8] positions) assembled into little-endian uint64 words."""
    shift = (tl.arange(0, 8).to(tl.uint64) * 8)[None, :]
    raw = tl.load(base + pos, mask=mask, other=0)
    return raw, tl.sum(raw.to(tl.uint64) << shift, axis=1)


@triton.jit
def _pcf64_kernel(src_ptr, partial_ptr, n, BLOCK_WORDS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    w = pid * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    pos = w[:, None] * 8 + tl.arange(0, 8)[None, :]
    _, words = load_words(src_ptr, pos, pos < n)
    terms = tl.where(w * 8 < n, pcf64_terms(words, w.to(tl.uint64)), 0)
    tl.store(partial_ptr + pid, tl.sum(terms, axis=0).to(tl.int64, bitcast=True))


def sum_partials(partials: torch.Tensor) -> int:
    """Add per-program partial sums (int64 bit patterns) modulo 2**64."""
    return int(partials.cpu().numpy().view(np.uint64).sum(dtype=np.uint64))


def pcf64(data: torch.Tensor) -> int:
    """pcf64 of a 1-D uint8 tensor on CUDA (or on CPU under ``TRITON_INTERPRET=1``)."""
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError("pcf64 (triton) needs a contiguous 1-D torch.uint8 tensor")
    n = data.numel()
    if n == 0:
        return pcf64_finalize(0, 0)
    blocks = triton.cdiv(n, BLOCK_WORDS * 8)
    partials = torch.empty(blocks, dtype=torch.int64, device=data.device)
    _pcf64_kernel[(blocks,)](data, partials, n, BLOCK_WORDS=BLOCK_WORDS)
    return pcf64_finalize(sum_partials(partials), n)
