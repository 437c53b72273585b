"""Lossy block quantization (int8, fp8 e4m3) with per-block absmax scales and error bounds.

Meant for optimizer moments (and optionally weights): each block of ``block_size``
elements keeps one fp32 scale, and every dequantized element is guaranteed within the
block's recorded ``error_bound`` of the original value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pcframe.kernels.dispatch import backend_module, resolve_backend
from pcframe.kernels.quantize.reference import QMAX

FORMATS: tuple[str, ...] = tuple(QMAX)
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_BLOCK_SIZE = 256
MAX_BLOCK_SIZE = 8192  # one block must fit one Triton program

# Unit roundoff of the dtype the dequantized fp32 values are cast back to.
_OUTPUT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# Where a result is subnormal the relative terms do not hold: a rounding there is off by up
# to half the dtype's smallest spacing (fp16: 2**-25, which Adam's exp_avg_sq reaches).
_OUTPUT_TINY = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}
_FP32_TINY = 4 * 2.0**-150  # the fp32 roundings of the scale, the division and the product

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FORMATS",
    "SUPPORTED_DTYPES",
    "QuantizedTensor",
    "dequantize_blockwise",
    "error_bounds",
    "quantize_blockwise",
]


@dataclass(frozen=True)
class QuantizedTensor:
    """A block-quantized tensor.

    Attributes:
        codes: Flat codes, ``torch.int8`` for ``"int8"``, ``torch.uint8`` e4m3fn bit
            patterns for ``"fp8_e4m3"``.
        scales: fp32 scale per block (``absmax / 127`` or ``absmax / 448``).
        error_bound: fp32 per block: a guaranteed bound on ``|x - dequantized x|``.
        fmt: ``"int8"`` or ``"fp8_e4m3"``.
        block_size: Elements per block (the last block may be shorter).
        shape: Original shape.
        dtype: Original dtype.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    error_bound: torch.Tensor
    fmt: str
    block_size: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def max_error(self) -> float:
        """Largest per-block error bound (0.0 for an empty tensor)."""
        return float(self.error_bound.max()) if self.error_bound.numel() else 0.0


def error_bounds(scales: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Per-block bound on the absolute error, derived from the scales alone.

    int8 rounds to the nearest multiple of ``scale`` (error <= scale / 2). e4m3 values
    of magnitude <= 448 are at most 32 apart (the spacing in [256, 448]), so the error
    is <= 16 * scale. 2**-20 * absmax covers the fp32 roundings of the scale, the
    division and the product; the next term covers the cast back to bf16 / fp16; the
    absolute terms cover the same roundings where results are subnormal.
    Computed in fp64 and rounded up to fp32 (in numpy: tiny torch ops can stall for
    milliseconds in torch's thread pool when the cores are busy).
    """
    s = scales.detach().cpu().numpy().astype(np.float64)
    absmax = s * QMAX[fmt]
    half_step = 0.5 if fmt == "int8" else 16.0
    bound = half_step * s + absmax * (2.0**-20 + _OUTPUT_ROUNDOFF[dtype] * (1 + 2.0**-10))
    bound += np.where(s > 0, _OUTPUT_TINY[dtype] + _FP32_TINY, 0.0)  # zeros stay exact
    b32 = bound.astype(np.float32)
    b32 = np.where(b32 < bound, np.nextafter(b32, np.float32(np.inf)), b32)
    return torch.from_numpy(b32).to(scales.device)


def _check_args(x: torch.Tensor, fmt: str, block_size: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; choose one of {FORMATS}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"block quantization takes {[str(d) for d in SUPPORTED_DTYPES]}, got {x.dtype}; "
            "keep other tensors on a lossless codec"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"block_size must be an int, got {block_size!r}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")


def _check_out(out: tuple[torch.Tensor, torch.Tensor], n: int, n_blocks: int, device) -> None:
    codes, scales = out
    if codes.dtype not in (torch.uint8, torch.int8) or codes.numel() != n:
        raise ValueError(f"out codes must be {n} uint8/int8 elements")
    if scales.dtype != torch.float32 or scales.numel() != n_blocks:
        raise ValueError(f"out scales must be {n_blocks} float32 elements")
    for t in out:
        if not t.is_contiguous() or t.device != device:
            raise ValueError(f"out tensors must be contiguous and on {device}")


def quantize_blockwise(
    x: torch.Tensor,
    fmt: str = "int8",
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    backend: str = "auto",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` (fp32 / bf16 / fp16, any shape and strides) block by block.

    Args:
        x: The tensor.
        fmt: ``"int8"`` or ``"fp8_e4m3"``.
        block_size: Elements per block (1 .. 8192).
        backend: ``"auto"``, ``"torch"``, ``"numba"`` or ``"triton"``.
        out: Optional preallocated ``(codes, scales)``: ``numel`` codes (uint8 or int8)
            and ``ceil(numel / block_size)`` fp32 scales on ``x``'s device; reusing
            buffers saves the page faults of fresh allocations.

    Raises:
        ValueError: Bad arguments, or ``x`` holds a NaN or an infinity (named by block).
    """
    _check_args(x, fmt, block_size)
    flat = x.detach().reshape(-1).contiguous()
    n = flat.numel()
    n_blocks = -(-n // block_size)
    impl = backend_module("quantize", resolve_backend(backend, x.device, op="quantize"))
    if out is None:
        codes = torch.empty(n, dtype=torch.uint8, device=x.device)
        scales = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
    else:
        _check_out(out, n, n_blocks, x.device)
        codes, scales = out[0].view(torch.uint8), out[1]
    block = impl.quantize(flat, fmt, block_size, codes, scales)
    if block >= 0:
        raise ValueError(
            f"cannot quantize: block {block} (elements {block * block_size}.."
            f"{(block + 1) * block_size - 1}) holds a NaN or an infinity"
        )
    return QuantizedTensor(
        codes=codes.view(torch.int8) if fmt == "int8" else codes,
        scales=scales,
        error_bound=error_bounds(scales, fmt, x.dtype),
        fmt=fmt,
        block_size=block_size,
        shape=tuple(x.shape),
        dtype=x.dtype,
    )


def dequantize_blockwise(
    q: QuantizedTensor, *, backend: str = "auto", out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: a tensor of ``q.dtype`` and ``q.shape``.

    Args:
        q: The quantized tensor.
        backend: ``"auto"``, ``"torch"``, ``"numba"`` or ``"triton"``.
        out: Optional tensor (``q.shape``, ``q.dtype``, any device and layout) to write
            into; it is returned.
    """
    if out is not None and (tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype):
        raise ValueError(f"out must have shape {q.shape} and dtype {q.dtype}")
    codes = q.codes.reshape(-1).view(torch.uint8)
    impl = backend_module("quantize", resolve_backend(backend, codes.device, op="dequantize"))
    direct = (
        out is not None
        and out.dtype == torch.float32
        and out.is_contiguous()
        and out.device == codes.device
    )
    values = out if direct else torch.empty(q.shape, dtype=torch.float32, device=codes.device)
    impl.dequantize(codes, q.scales, q.fmt, q.block_size, values.view(-1))
    if out is None:
        return values.to(q.dtype)
    if not direct:
        out.copy_(values)
    return out
