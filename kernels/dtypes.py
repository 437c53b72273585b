"""Stable names of tensor dtypes: what manifests and codec metadata record.

Names are stable across torch versions (``"bfloat16"``, ``"float8_e4m3fn"``) and map back
to exactly one dtype, so a file names its dtypes without pickling them. Dtypes newer torch
builds add (float8, wide unsigned ints) are known where the running torch has them.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "dtype_name"]

# name <-> torch dtype
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Stable name of a dtype, e.g. ``"bfloat16"`` (``DTYPES[dtype_name(d)] is d``).

    Raises:
        TypeError: a dtype pcframe cannot store (quantized, sub-byte, ...).
    """
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"pcframe cannot store tensors of dtype {dtype}") from None
