"""Block quantization in Triton, bit-exact with ``reference.py``.

Rounding is done without libdevice (which the interpreter lacks): round-half-even of
|y| < 2**22 as ``(y + 1.5 * 2**23) - 1.5 * 2**23``, and the fp8 mantissa rounding on the
fp32 bits, so the kernel also runs on GPUs without native fp8 (before sm_89). Launches
pass ``enable_fp_fusion=False``: an FMA fused into that addition would round once
instead of twice and break bit-exactness. Divisions use ``div_rn`` (the default fp32
division on NVIDIA GPUs is approximate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcframe.kernels.quantize.reference import code_values, first_bad_block

_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
TILE = 2048  # elements per program: several small blocks, or one block of up to 8192


@triton.jit
def _to_e4m3(y):
    """fp32 (|y| <= 448) -> e4m3fn code bits, round half to even."""
    u = y.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    mag = u & 0x7FFFFFFF
    r = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    sub = ((tl.abs(y) * 512.0 + _ROUND_MAGIC) - _ROUND_MAGIC).to(tl.uint32)
    return (tl.where(mag < 0x3C800000, sub, normal) | sign).to(tl.uint8)


@triton.jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    n,
    block_size,
    n_blocks,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    FP8: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    offs = rows[:, None] * block_size + cols[None, :]
    mask = (cols[None, :] < block_size) & (offs < n)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # The absmax is an integer max over the magnitude bits (they order like the float
    # magnitudes); NaN and inf show up as >= 0x7F800000. Non-finite values are zeroed
    # first, so no arithmetic below makes a NaN (or an FP warning in the interpreter).
    mag = x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    finite = mag < 0x7F800000
    bad = tl.max(mag, axis=1) >= 0x7F800000
    x = tl.where(finite, x, 0.0)
    absmax = tl.max(tl.where(finite, mag, 0), axis=1).to(tl.float32, bitcast=True)
    qmax = 448.0 if FP8 else 127.0
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, qmax, tl.float32))
    # Below 2**-64, qmax / absmax can overflow (below ~2**-121): scale the block by 2**64
    # first (exact: a power of two), as the torch and numba kernels do.
    boost = tl.where(
        absmax < 5.421010862427522e-20,  # 2**-64
        tl.full(absmax.shape, 1.8446744073709552e19, tl.float32),  # 2**64, an fp32 product
        tl.full(absmax.shape, 1.0, tl.float32),
    )
    safe = tl.where(absmax > 0, absmax * boost, 1.0)
    inv = tl.where(absmax > 0, tl.math.div_rn(tl.full(absmax.shape, qmax, tl.float32), safe), 0.0)
    y = (x * boost[:, None]) * inv[:, None]
    if FP8:
        codes = _to_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
    else:
        q = (y + _ROUND_MAGIC) - _ROUND_MAGIC
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        codes = q.to(tl.int32).to(tl.uint8)
    tl.store(codes_ptr + offs, codes, mask=mask)
    nan = tl.full(scale.shape, 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)
    tl.store(scales_ptr + rows, tl.where(bad, nan, scale), mask=rows < n_blocks)


@triton.jit
def _dequantize_kernel(
    codes_ptr, values_ptr, scales_ptr, out_ptr, n, block_size, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    values = tl.load(values_ptr + codes, mask=mask, other=0.0)
    scales = tl.load(scales_ptr + offs // block_size, mask=mask, other=0.0)
    tl.store(out_ptr + offs, values * scales, mask=mask)


def quantize(
    x: torch.Tensor, fmt: str, block_size: int, codes: torch.Tensor, scales: torch.Tensor
) -> int:
    """Quantize a flat contiguous tensor into uint8 ``codes`` and fp32 ``scales``.

    Returns the first block holding a NaN or an infinity, or -1 (this synchronizes).
    """
    n = x.numel()
    n_blocks = scales.numel()
    if n:
        cols = triton.next_power_of_2(block_size)
        rows = max(1, TILE // cols)
        _quantize_kernel[(triton.cdiv(n_blocks, rows),)](
            x,
            codes,
            scales,
            n,
            block_size,
            n_blocks,
            ROWS=rows,
            COLS=cols,
            FP8=fmt != "int8",
            enable_fp_fusion=False,
        )
    return first_bad_block(scales)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, block_size: int, out: torch.Tensor
) -> None:
    """fp32 values of flat uint8 ``codes`` with per-block ``scales``, into ``out``."""
    n = codes.numel()
    if n:
        block = 1024
        values = code_values(fmt, codes.device)
        _dequantize_kernel[(triton.cdiv(n, block),)](
            codes, values, scales, out, n, block_size, BLOCK=block
        )
