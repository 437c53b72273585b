"""Block quantization in plain torch: the specification and the fallback.

For a flat fp32 tensor x cut into blocks of ``block_size`` elements (the last one may
be shorter), with Q = 127 for ``"int8"`` and Q = 448 for ``"fp8_e4m3"``, in fp32:

    absmax = max |x| over the block            (a non-finite value is an error)
    scale  = absmax / Q                        (correctly rounded division)
    b      = 2**64 if absmax < 2**-64 else 1  (Q / absmax would overflow for tiny blocks)
    inv    = Q / (absmax * b), or 0 when absmax == 0   (correctly rounded division)
    y      = (x * b) * inv                     (the products by b are exact)
    int8:     code = clamp(round_half_even(y), -127, 127)
    fp8_e4m3: code = float8_e4m3fn(clamp(y, -448, 448)) (round half to even, its bits)
    dequantized value = value(code) * scale    (then cast to the original dtype)

Codes are stored as uint8 bit patterns in both formats (int8 codes two's complement).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
TINY, BOOST = 2.0**-64, 2.0**64  # blocks with absmax below TINY are scaled by BOOST first


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    n = x.numel()
    n_blocks = -(-n // block_size)
    return F.pad(x, (0, n_blocks * block_size - n)).view(n_blocks, block_size)


def first_bad_block(scales: torch.Tensor) -> int:
    """Index of the first NaN scale (a block with a NaN or an infinity), or -1."""
    bad = torch.isnan(scales).nonzero()
    return int(bad[0, 0]) if bad.numel() else -1


def quantize(
    x: torch.Tensor, fmt: str, block_size: int, codes: torch.Tensor, scales: torch.Tensor
) -> int:
    """Quantize flat ``x`` into uint8 ``codes`` [n] and fp32 ``scales`` [n_blocks].

    A block holding a NaN or an infinity gets a NaN scale; returns the first such
    block, or -1.
    """
    n = x.numel()
    xb = _blocks(x.float(), block_size)
    absmax = xb.abs().amax(dim=1)  # NaN propagates
    absmax = torch.where(torch.isfinite(xb).all(dim=1), absmax, torch.nan)
    qmax = QMAX[fmt]
    # Below 2**-64, qmax / absmax can overflow (below ~2**-121): the block is scaled by
    # 2**64 first (exact: a power of two), in every backend alike.
    boost = torch.where(absmax < TINY, BOOST, 1.0)
    # A tensor numerator: `qmax / tensor` is computed as qmax * reciprocal (two roundings),
    # not the correctly rounded division the other kernels do.
    inv = torch.where(absmax > 0, torch.full_like(absmax, qmax) / (absmax * boost), 0.0)
    if bool((boost != 1.0).any()):  # rare: skip a pass over the data when no block is tiny
        xb = xb * boost[:, None]
    y = xb * inv[:, None]
    if fmt == "int8":
        q = torch.round(y).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        q = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    codes.copy_(q.reshape(-1)[:n])
    scales.copy_(absmax / qmax)
    return first_bad_block(scales)


def code_values(fmt: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 value of each of the 256 code bytes (the decoding table)."""
    codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    if fmt == "int8":
        return codes.view(torch.int8).float()
    return codes.view(torch.float8_e4m3fn).float()


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, block_size: int, out: torch.Tensor
) -> None:
    """fp32 values of flat uint8 ``codes`` with per-block ``scales``, into ``out``."""
    n = codes.numel()
    values = code_values(fmt, codes.device)[codes.long()]
    out.copy_((_blocks(values, block_size) * scales[:, None]).reshape(-1)[:n])
