"""The block-quantized codecs (lossy, bound recorded): int8 or fp8 codes, fp32 block scales."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pcframe.kernels._tensor_bytes import as_uint8_tensor, byte_view
from pcframe.kernels.codecs.base import Codec, host_bytes, register_codec
from pcframe.kernels.codecs.meta import check_block_meta, check_block_values, require
from pcframe.kernels.dtypes import dtype_name
from pcframe.kernels.quantize import (
    DEFAULT_BLOCK_SIZE,
    MAX_BLOCK_SIZE,
    QuantizedTensor,
    dequantize_blockwise,
    error_bounds,
    quantize_blockwise,
)
from pcframe.kernels.quantize.reference import QMAX


class _BlockQuantCodec(Codec):
    """Shared body of the block-quantized codecs: payload = codes, pad to 4, fp32 scales."""

    lossless = False
    fmt: ClassVar[str]

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        # Checked here, so a bad value fails when the engine config is built, not at a save.
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise ValueError(f"block_size must be an int, got {block_size!r}")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size={block_size} must be in 1..{MAX_BLOCK_SIZE}")
        self.block_size = block_size

    def config(self) -> dict[str, Any]:
        return {"block_size": self.block_size}

    def _encode(self, tensor, previous):
        q = quantize_blockwise(tensor, self.fmt, self.block_size)
        # The largest code times its scale is what the block's largest value decodes to; at
        # the dtype's limit (a finfo.min mask) it can round past it to infinity, which no
        # reader accepts: refuse here, where the save can fail without losing anything.
        top = (q.scales.float() * float(QMAX[self.fmt])).to(tensor.dtype)
        if not bool(torch.isfinite(top).all()):
            block = int((~torch.isfinite(top)).nonzero()[0, 0])
            raise ValueError(
                f"block {block} holds values at the {dtype_name(tensor.dtype)} limit "
                f"(±{torch.finfo(tensor.dtype).max:.4g}), which {self.name} would decode to "
                "infinity"
            )
        codes = host_bytes(q.codes)
        scales_offset = -(-codes.numel() // 4) * 4
        payload = torch.zeros(scales_offset + 4 * q.scales.numel(), dtype=torch.uint8)
        payload[: codes.numel()] = codes
        payload[scales_offset:] = byte_view(q.scales.cpu())
        meta = {
            "fmt": self.fmt,
            "block_size": self.block_size,
            "n_blocks": q.scales.numel(),
            "codes_nbytes": codes.numel(),
            "scales_offset": scales_offset,
            "scales_dtype": "float32",
            "error_bound": q.max_error,
            "source_dtype": dtype_name(tensor.dtype),
        }
        return payload.numpy(), meta

    def _check_meta(self, meta, dtype, shape, itemsize, payload_nbytes):
        check_block_meta(meta, self.name, self.fmt, dtype, shape, payload_nbytes)

    def _decode(self, payload, meta, dtype, shape, previous, out):
        get = lambda key: require(meta, key, self.name)  # noqa: E731
        data = as_uint8_tensor(payload)
        n, n_blocks, offset = get("codes_nbytes"), get("n_blocks"), get("scales_offset")
        device = out.device if out is not None else torch.device("cpu")
        scales = torch.empty(n_blocks, dtype=torch.float32)
        byte_view(scales).copy_(data[offset:])
        overflow_possible = check_block_values(self.name, self.fmt, data[:n], scales, dtype)
        codes = data[:n].to(device)
        scales = scales.to(device)
        q = QuantizedTensor(
            codes=codes if self.fmt != "int8" else codes.view(torch.int8),
            scales=scales,
            error_bound=error_bounds(scales, self.fmt, dtype),
            fmt=self.fmt,
            block_size=int(get("block_size")),
            shape=shape,
            dtype=dtype,
        )
        result = dequantize_blockwise(q, out=out)
        if overflow_possible and not bool(torch.isfinite(result).all()):
            raise ValueError(
                f"codec {self.name!r}: scales near the {dtype_name(dtype)} limit decode to "
                "infinities (the encoder never writes such a payload)"
            )
        return result


@register_codec
class Int8BlockCodec(_BlockQuantCodec):
    """int8 codes with per-block absmax scales (lossy, bound recorded in meta)."""

    name = "int8_block"
    fmt = "int8"


@register_codec
class Fp8BlockCodec(_BlockQuantCodec):
    """fp8 e4m3fn codes with per-block absmax scales (lossy, bound recorded in meta)."""

    name = "fp8_block"
    fmt = "fp8_e4m3"
