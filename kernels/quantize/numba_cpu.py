"""Block quantization with Numba, bit-exact with ``reference.py``.

Each block is scanned twice while it sits in L1 (absmax, then codes), so memory is
read once. The loops are small inlined helpers over array slices, written so LLVM
vectorizes them: the absmax is an integer max over the magnitude bits (it orders like
the float magnitudes, and any NaN or infinity shows up as >= 0x7F800000, so one
reduction also finds non-finite values), and the fp8 rounding is integer arithmetic
on the fp32 bits with a select instead of a branch. bf16 and fp16 arrive as uint16
bits and are widened exactly with integer ops (NumPy-in-Numba has no bf16 / fp16).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import types
from numba.extending import overload

from pcframe.kernels._numba_util import NJIT, address_as_pointer, bits_f32, f32_bits
from pcframe.kernels.quantize.reference import code_values

KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_INLINE = {**NJIT, "inline": "always"}
_NOT_FINITE = np.int32(0x7F800000)  # magnitude bits of +inf; NaNs are above
_FP8_MIN_NORMAL = np.uint32(0x3C800000)  # 2**-6 as fp32 bits
_F16_SUBNORMAL_UNIT = np.float32(2.0**-24)


def as_f32(v):  # pragma: no cover - replaced by the overload inside Numba code
    """fp32 value of one element: fp32 as is, uint16 read as bf16 bits (exact)."""
    raise NotImplementedError


@overload(as_f32, inline="always")
def _as_f32_overload(v):  # picks the implementation for the argument's Numba type
    if v == types.float32:
        return lambda v: v
    if v == types.uint16:
        return lambda v: bits_f32(np.uint32(v) << np.uint32(16))
    return None


@numba.njit(**_INLINE)
def _widen_f16(src: np.ndarray, row: np.ndarray) -> None:
    # Subnormals (exponent 0) are m * 2**-24: exact as fp32 normals, made by a float
    # multiply; everything else is re-biased bits. Selects, no branches.
    for i in range(src.size):
        h = np.uint32(src[i])
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        exp = (h >> np.uint32(10)) & np.uint32(0x1F)
        rest = (h & np.uint32(0x7FFF)) << np.uint32(13)
        normal = rest + np.uint32(112 << 23)
        normal = normal if exp != 31 else (rest | np.uint32(0x7F800000))
        sub = f32_bits(np.float32(h & np.uint32(0x3FF)) * _F16_SUBNORMAL_UNIT)
        row[i] = bits_f32(sign | (sub if exp == 0 else normal))


_TINY = np.float32(2.0**-64)  # blocks whose absmax is below this are scaled by _BOOST
_BOOST = np.float32(2.0**64)


@numba.njit(**_INLINE)
def _magnitude_max(x: np.ndarray) -> np.int32:
    m = np.int32(0)
    for i in range(x.size):
        m = max(m, np.int32(f32_bits(as_f32(x[i])) & np.uint32(0x7FFFFFFF)))
    return m


@numba.njit(**_INLINE)
def _codes_int8(x: np.ndarray, inv: np.float32, codes: np.ndarray) -> None:
    for i in range(x.size):
        q = np.int32(np.rint(as_f32(x[i]) * inv))  # |x * inv| <= 127 (+ rounding)
        codes[i] = np.uint8(min(max(q, -127), 127))


@numba.njit(**_INLINE)
def _codes_fp8(x: np.ndarray, inv: np.float32, codes: np.ndarray) -> None:
    for i in range(x.size):
        y = min(max(as_f32(x[i]) * inv, np.float32(-448.0)), np.float32(448.0))
        u = f32_bits(y)
        mag = u & np.uint32(0x7FFFFFFF)
        # Normal: round the mantissa to 3 bits, half to even (a carry bumps the exponent).
        r = mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))
        normal = (((r >> np.uint32(23)) - np.uint32(120)) << np.uint32(3)) | (
            (r >> np.uint32(20)) & np.uint32(7)
        )
        # Subnormal (|y| < 2**-6): multiples of 2**-9; the product is exact.
        sub = np.uint32(np.int32(np.rint(abs(y) * np.float32(512.0))))
        code = sub if mag < _FP8_MIN_NORMAL else normal
        codes[i] = np.uint8(((u >> np.uint32(24)) & np.uint32(0x80)) | code)


@numba.njit(**_INLINE)
def _quantize_block(x: np.ndarray, fp8: bool, codes: np.ndarray) -> np.float32:
    """Codes of one block (fp32 or bf16-bits elements); returns its scale (NaN if non-finite)."""
    m = _magnitude_max(x)
    if m >= _NOT_FINITE:
        return np.float32(np.nan)
    qmax = np.float32(448.0) if fp8 else np.float32(127.0)
    absmax = bits_f32(np.uint32(m))
    if absmax > 0 and absmax < _TINY:
        # Below 2**-64, qmax / absmax can overflow (below ~2**-121): a copy of the block
        # scaled by 2**64 (exact: a power of two) takes its place, as in the torch and
        # Triton kernels. Rare, so the common loop below keeps one product per element.
        boosted = np.empty(x.size, dtype=np.float32)
        for i in range(x.size):
            boosted[i] = as_f32(x[i]) * _BOOST
        _codes(boosted, fp8, qmax / (absmax * _BOOST), codes)
    else:
        _codes(x, fp8, qmax / absmax if absmax > 0 else np.float32(0.0), codes)
    return absmax / qmax


@numba.njit(**_INLINE)
def _codes(x: np.ndarray, fp8: bool, inv: np.float32, codes: np.ndarray) -> None:
    if fp8:
        _codes_fp8(x, inv, codes)
    else:
        _codes_int8(x, inv, codes)


@numba.njit(**NJIT)
def _quantize_direct(
    src: np.ndarray, block: int, fp8: bool, codes: np.ndarray, scales: np.ndarray
) -> int:
    """Blocks read straight from ``src`` (fp32, or uint16 holding bf16)."""
    first_bad = -1
    n = src.size
    for b in range(scales.shape[0]):
        start = b * block
        stop = min(start + block, n)
        scales[b] = _quantize_block(src[start:stop], fp8, codes[start:stop])
        if scales[b] != scales[b] and first_bad < 0:
            first_bad = b
    return first_bad


@numba.njit(**NJIT)
def _quantize_f16(
    src: np.ndarray, block: int, fp8: bool, codes: np.ndarray, scales: np.ndarray
) -> int:
    """Blocks of fp16 bits, widened to an L1-resident fp32 row first."""
    first_bad = -1
    n = src.size
    row = np.empty(block, dtype=np.float32)
    for b in range(scales.shape[0]):
        start = b * block
        stop = min(start + block, n)
        x = row[: stop - start]
        _widen_f16(src[start:stop], x)
        scales[b] = _quantize_block(x, fp8, codes[start:stop])
        if scales[b] != scales[b] and first_bad < 0:
            first_bad = b
    return first_bad


@numba.njit(**NJIT)
def quantize_blocks(
    addr: int,
    kind: int,
    n: int,
    block: int,
    fp8: bool,
    codes: np.ndarray,
    scales: np.ndarray,
) -> int:
    """Quantize ``n`` elements at ``addr`` (kind 0 fp32, 1 bf16, 2 fp16) into ``codes``/``scales``.

    Returns the index of the first block holding a NaN or an infinity (it gets a NaN
    scale and unspecified codes), or -1.
    """
    if kind == 0:
        src32 = numba.carray(address_as_pointer(addr, np.float32), (n,))
        return _quantize_direct(src32, block, fp8, codes, scales)
    src16 = numba.carray(address_as_pointer(addr, np.uint16), (n,))
    if kind == 1:
        return _quantize_direct(src16, block, fp8, codes, scales)
    return _quantize_f16(src16, block, fp8, codes, scales)


@numba.njit(**NJIT)
def dequantize_blocks(
    codes: np.ndarray,
    fp8: bool,
    values: np.ndarray,
    scales: np.ndarray,
    block: int,
    out: np.ndarray,
) -> None:
    """``out[i] = value(codes[i]) * scales[i // block]`` in fp32 (int8: two's complement)."""
    n = codes.shape[0]
    for b in range(scales.shape[0]):
        s = scales[b]
        start = b * block
        stop = min(start + block, n)
        c = codes[start:stop]
        o = out[start:stop]
        if fp8:
            for i in range(c.size):
                o[i] = values[c[i]] * s
        else:
            for i in range(c.size):
                o[i] = np.float32(np.int8(c[i])) * s


def quantize(
    x: torch.Tensor, fmt: str, block_size: int, codes: torch.Tensor, scales: torch.Tensor
) -> int:
    """Quantize a flat contiguous CPU tensor into uint8 ``codes`` and fp32 ``scales``.

    Returns the first block holding a NaN or an infinity, or -1.
    """
    if not x.numel():
        return -1
    args = (x.data_ptr(), KIND[x.dtype], x.numel(), block_size, fmt != "int8")
    return int(quantize_blocks(*args, codes.numpy(), scales.numpy()))


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, block_size: int, out: torch.Tensor
) -> None:
    """fp32 values of flat uint8 CPU ``codes`` with per-block ``scales``, into ``out``."""
    values = code_values(fmt).numpy()
    c, s, o = codes.numpy(), scales.contiguous().numpy(), out.numpy()
    dequantize_blocks(c, fmt != "int8", values, s, block_size, o)
