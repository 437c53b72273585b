"""What the codecs check before decoding: their meta, the payload size, the decoded values.

A codec's meta comes from a manifest, which may be hostile even when its checksums hold. Every
key a decoder reads is checked here for its type and range, and every size it records against
the tensor it is to become, so a bad value is a ``ValueError`` naming the codec and the key,
never a wrong-sized read, an uninitialised tensor or an exception from deep inside a kernel.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pcframe.kernels._tensor_bytes import BytesLike
from pcframe.kernels.dtypes import DTYPE_NAMES, dtype_name
from pcframe.kernels.quantize import MAX_BLOCK_SIZE, SUPPORTED_DTYPES
from pcframe.kernels.quantize.reference import QMAX


def numel_of(shape: Sequence[int]) -> int:
    """Elements of ``shape`` (Python ints: no overflow)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def require(meta: Mapping[str, Any], key: str, codec: str) -> Any:
    """``meta[key]``, which must be there."""
    if key not in meta:
        raise ValueError(f"codec {codec!r}: meta lacks key {key!r}")
    return meta[key]


ABSENT = object()  # "no default": the key is required


def meta_int(
    meta: Mapping[str, Any], key: str, codec: str, lo: int, hi: int, default: Any = ABSENT
) -> int:
    """``meta[key]`` as an int in ``[lo, hi]`` (``default`` when absent, if given)."""
    if default is not ABSENT and key not in meta:
        return default
    value = require(meta, key, codec)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(
            f"codec {codec!r}: meta {key!r} must be an integer in [{lo}, {hi}], got {value!r:.40}"
        )
    return value


def meta_flag(meta: Mapping[str, Any], key: str, codec: str, default: Any = ABSENT) -> bool:
    """``meta[key]`` as a JSON boolean (``default`` when absent, if given)."""
    if default is not ABSENT and key not in meta:
        return default
    value = require(meta, key, codec)
    if not isinstance(value, bool):
        raise ValueError(f"codec {codec!r}: meta {key!r} must be true or false, got {value!r:.40}")
    return value


def meta_equal(meta: Mapping[str, Any], key: str, codec: str, expected: Any) -> None:
    """An optional meta key that, when present, must hold exactly ``expected``."""
    if key in meta and (type(meta[key]) is not type(expected) or meta[key] != expected):
        raise ValueError(
            f"codec {codec!r}: meta {key!r} is {meta[key]!r:.40}, expected {expected!r}"
        )


def payload_size(payload: BytesLike) -> int:
    """Bytes of a payload, whatever bytes-like object holds it."""
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, np.ndarray):
        return int(payload.nbytes)
    return memoryview(payload).nbytes


def element_size_of(dtype: torch.dtype, codec: str) -> int:
    """Bytes per element of a dtype pcframe stores (others cannot be decoded into)."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"codec {codec!r}: cannot decode into dtype {dtype}")
    return torch.empty(0, dtype=dtype).element_size()


def decode_shape(shape: Sequence[int], codec: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative Python ints."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(f"codec {codec!r}: shape {shape!r:.40} is not a sequence") from None
    if not all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in dims) or any(
        d < 0 for d in dims
    ):
        raise ValueError(f"codec {codec!r}: shape {shape!r:.80} must be non-negative integers")
    return tuple(int(d) for d in dims)


def check_zstd_meta(
    meta: Mapping[str, Any], codec: str, nbytes: int, payload_nbytes: int, shuffle: Any
) -> None:
    """The meta of the zstd codecs: shuffle flag, level, and the decoded size if recorded."""
    meta_flag(meta, "shuffle", codec, *(() if shuffle is None else (shuffle,)))
    meta_int(meta, "level", codec, -7, 22, default=0)  # what ShuffleZstd accepts
    meta_int(meta, "nbytes", codec, nbytes, nbytes, default=nbytes)
    if payload_nbytes < 1 and nbytes:
        raise ValueError(f"codec {codec!r}: an empty payload cannot hold {nbytes} bytes")


def check_block_meta(
    meta: Mapping[str, Any],
    name: str,
    fmt: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    payload_nbytes: int,
) -> None:
    """The meta of the block-quantized codecs, against the tensor and the payload size."""
    recorded = require(meta, "fmt", name)
    if not isinstance(recorded, str) or recorded != fmt:
        raise ValueError(f"codec {name!r}: meta fmt {recorded!r:.40} is not {fmt!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"codec {name!r}: decodes to {[dtype_name(d) for d in SUPPORTED_DTYPES]}, "
            f"not {dtype_name(dtype)}"
        )
    n = numel_of(shape)
    block_size = meta_int(meta, "block_size", name, 1, MAX_BLOCK_SIZE)
    blocks = -(-n // block_size)
    meta_int(meta, "codes_nbytes", name, n, n)
    meta_int(meta, "n_blocks", name, blocks, blocks)
    meta_int(meta, "scales_offset", name, -(-n // 4) * 4, -(-n // 4) * 4)
    meta_equal(meta, "scales_dtype", name, "float32")
    meta_equal(meta, "source_dtype", name, dtype_name(dtype))
    bound = meta.get("error_bound", 0.0)
    if (
        isinstance(bound, bool)
        or not isinstance(bound, int | float)
        or not (math.isfinite(bound) and bound >= 0)
    ):
        raise ValueError(
            f"codec {name!r}: meta 'error_bound' must be a finite number >= 0, got {bound!r:.40}"
        )
    expected = -(-n // 4) * 4 + 4 * blocks
    if payload_nbytes != expected:
        raise ValueError(
            f"codec {name!r}: payload has {payload_nbytes} bytes, {dtype_name(dtype)}{shape} "
            f"in blocks of {block_size} needs {expected}"
        )


def check_block_values(
    name: str, fmt: str, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> bool:
    """Scales and codes the encoder could have written; True if a value may still overflow.

    The encoder refuses non-finite input, so its scales are finite, >= 0 and at most
    ``finfo(dtype).max / QMAX`` (rounding aside); fp8 codes never hold e4m3fn's NaN. Only
    scales near that limit (never seen outside hostile files) need the output checked.
    """
    s = scales.numpy()
    top = float(torch.finfo(dtype).max)
    limit = top / QMAX[fmt] * (1 + 2.0**-10)
    if s.size and not (np.isfinite(s).all() and (s >= 0).all() and s.max() <= limit):
        bad = int(np.flatnonzero(~(np.isfinite(s) & (s >= 0) & (s <= limit)))[0])
        raise ValueError(
            f"codec {name!r}: block {bad} has scale {float(s[bad])!r}, not a finite "
            f"value in [0, {limit:.4g}] ({dtype_name(dtype)})"
        )
    if fmt == "fp8_e4m3" and codes.numel():
        nan = torch.bitwise_and(codes, 0x7F) == 0x7F
        if bool(nan.any()):
            raise ValueError(
                f"codec {name!r}: element {int(nan.nonzero()[0, 0])} holds an e4m3fn NaN code"
            )
    return bool(s.size) and float(s.max()) * (QMAX[fmt] + 1) > top / 2
