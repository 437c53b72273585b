"""Delta encoding against the previous version: XOR of the bit patterns.

``decode_delta(encode_delta(cur, prev), prev)`` reproduces ``cur`` bit for bit. Which
versions are full and which are deltas (e.g. a full one every K versions) is the
caller's policy; these are the primitives.
"""

from __future__ import annotations

import torch

from pcframe.kernels._tensor_bytes import BytesLike, as_uint8_tensor, byte_view, tensor_nbytes
from pcframe.kernels.dispatch import backend_module, common_device, resolve_backend

__all__ = ["decode_delta", "encode_delta"]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return byte_view(t.detach().contiguous())


def encode_delta(
    cur: torch.Tensor,
    prev: torch.Tensor,
    *,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bytes of ``cur`` XOR bytes of ``prev`` as a 1-D uint8 tensor on their device.

    Args:
        cur: The current version.
        prev: The previous version (same dtype, shape and device).
        backend: ``"auto"``, ``"torch"``, ``"numba"`` or ``"triton"``.
        out: Optional preallocated contiguous 1-D uint8 output of ``cur``'s byte size.

    Raises:
        ValueError: ``cur`` and ``prev`` differ in dtype, shape or device, or a bad ``out``.
    """
    if cur.dtype != prev.dtype or cur.shape != prev.shape:
        raise ValueError(
            f"delta needs the same dtype and shape: {cur.dtype}{tuple(cur.shape)} vs "
            f"previous {prev.dtype}{tuple(prev.shape)}"
        )
    device = common_device(cur, prev)
    if cur.device != prev.device:
        raise ValueError(f"cur is on {cur.device}, prev on {prev.device}")
    impl = backend_module("delta", resolve_backend(backend, device, op="encode_delta"))
    n = tensor_nbytes(cur)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.shape != (n,) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-D uint8 tensor of {n} bytes")
    impl.xor_bytes(_bytes_of(cur), _bytes_of(prev), out)
    return out


def decode_delta(
    delta: BytesLike,
    prev: torch.Tensor,
    *,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rebuild the current version from its delta and the previous version.

    Args:
        delta: The bytes :func:`encode_delta` returned (tensor or bytes-like).
        prev: The previous version (same dtype and shape as the result).
        backend: ``"auto"``, ``"torch"``, ``"numba"`` or ``"triton"``.
        out: Optional tensor like ``prev`` to write into (may be ``prev`` itself).

    Raises:
        ValueError: ``delta`` has the wrong length, or ``out`` does not match ``prev``.
    """
    d = delta if isinstance(delta, torch.Tensor) else as_uint8_tensor(delta)
    d = byte_view(d.detach().contiguous()).to(prev.device)
    if d.numel() != tensor_nbytes(prev):
        raise ValueError(f"delta has {d.numel()} bytes, the previous version {tensor_nbytes(prev)}")
    if out is not None and (out.dtype != prev.dtype or out.shape != prev.shape):
        raise ValueError(f"out must be {prev.dtype}{tuple(prev.shape)}")
    impl = backend_module("delta", resolve_backend(backend, prev.device, op="decode_delta"))
    prev_bytes = _bytes_of(prev)
    target = out if out is not None and out.is_contiguous() else None
    result = (
        target
        if target is not None
        else torch.empty_like(prev, memory_format=torch.contiguous_format)
    )
    impl.xor_bytes(d, prev_bytes, byte_view(result))
    if out is not None and target is None:
        out.copy_(result)
        return out
    return result
