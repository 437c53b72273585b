"""Gather many tensors into one flat byte buffer, and scatter them back.

The API is byte-range based because the engine cuts the flat layout into fixed-size
chunks and a chunk boundary may split a tensor: each :class:`Piece` says which bytes of
which tensor go where in the buffer (the buffer is typically one chunk).

On CUDA the copy runs on a side stream that first waits for the training stream; the
returned :class:`Completion` carries the CUDA event (``block_stream()`` gates the
optimizer step on it without a host sync). On CPU it has finished on return.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pcframe.kernels._completion import Completion, on_side_stream
from pcframe.kernels.copy._plan import Piece, PieceLike, Plan, check_buffer, make_plan
from pcframe.kernels.dispatch import backend_module, common_device, resolve_backend

__all__ = [
    "Completion",
    "Piece",
    "PieceLike",
    "Plan",
    "gather",
    "gather_checksum",
    "scatter",
]


def _prepare(
    pieces: Iterable[PieceLike], buffer: torch.Tensor
) -> tuple[list[PieceLike], torch.device]:
    check_buffer(buffer, "buffer")
    items = list(pieces)
    tensors = [p[0] for p in items if isinstance(p[0], torch.Tensor)]
    return items, common_device(buffer, *tensors)


def _cuda_tensors(pieces: list[PieceLike]) -> list[torch.Tensor]:
    return [p[0] for p in pieces if isinstance(p[0], torch.Tensor) and p[0].is_cuda]


def gather(
    pieces: Iterable[PieceLike],
    dst: torch.Tensor,
    *,
    backend: str = "auto",
    zero_fill: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> Completion[None]:
    """Copy tensor byte ranges into the flat buffer ``dst``.

    Args:
        pieces: :class:`Piece` objects or ``(tensor, tensor_offset, buffer_offset, nbytes)``
            tuples; tensors of any dtype, contiguous or not. Pieces must not overlap in
            ``dst``.
        dst: 1-D contiguous ``torch.uint8`` buffer (pinned host memory for GPU snapshots).
        backend: ``"auto"``, ``"torch"``, ``"numba"`` or ``"triton"``.
        zero_fill: Also zero every byte of ``dst`` no piece covers (alignment padding).
        stream: CUDA stream to copy on (default: a per-device side stream).

    Returns:
        A :class:`Completion`; wait on it (or ``block_stream()``) before reading ``dst``.
    """
    checked, device = _prepare(pieces, dst)
    impl = backend_module("copy", resolve_backend(backend, device, op="gather"))
    with on_side_stream(device, stream) as s:
        # Planned on the side stream: staging strided sources must not cost the trainer.
        plan = make_plan(checked, dst, scatter=False)
        keep = impl.gather(plan, dst, zero_fill)
    return Completion.record(
        s, keepalive=[dst, *plan.keepalive, *keep], cuda_sources=_cuda_tensors(checked)
    )


def gather_checksum(
    pieces: Iterable[PieceLike],
    dst: torch.Tensor,
    *,
    backend: str = "auto",
    stream: torch.cuda.Stream | None = None,
) -> Completion[int]:
    """Zero-filling :func:`gather` fused with the ``"pcf64"`` checksum of all of ``dst``.

    ``gather_checksum(pieces, dst).result() == checksum(dst, "pcf64")`` after the call,
    computed in the same pass over the bytes as the copy.
    """
    checked, device = _prepare(pieces, dst)
    impl = backend_module("copy", resolve_backend(backend, device, op="gather_checksum"))
    with on_side_stream(device, stream) as s:
        plan = make_plan(checked, dst, scatter=False)
        value, keep = impl.gather_checksum(plan, dst)
    return Completion.record(
        s, value, keepalive=[dst, *plan.keepalive, *keep], cuda_sources=_cuda_tensors(checked)
    )


def scatter(
    src: torch.Tensor,
    pieces: Iterable[PieceLike],
    *,
    backend: str = "auto",
    stream: torch.cuda.Stream | None = None,
) -> Completion[None]:
    """Copy ranges of the flat buffer ``src`` back into tensors (inverse of :func:`gather`).

    Each piece's ``nbytes`` bytes at ``buffer_offset`` of ``src`` overwrite the tensor's
    logical bytes at ``tensor_offset``. Target ranges must not overlap.
    """
    checked, device = _prepare(pieces, src)
    impl = backend_module("copy", resolve_backend(backend, device, op="scatter"))
    with on_side_stream(device, stream) as s:
        plan = make_plan(checked, src, scatter=True)
        keep = impl.scatter(plan, src)
    return Completion.record(
        s, keepalive=[src, *plan.keepalive, *keep], cuda_sources=_cuda_tensors(checked)
    )
