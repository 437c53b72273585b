"""Gather / scatter in plain torch: the specification and the fallback.

``gather``: for every piece, buffer[buffer_offset : buffer_offset + nbytes] = the
tensor's logical bytes [tensor_offset, tensor_offset + nbytes); with ``zero_fill``
every buffer byte no piece covers becomes 0. ``scatter`` is the inverse. Works on any
device pair torch can copy between (on CUDA each piece is one async memcpy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pcframe.kernels._tensor_bytes import copy_bytes, read_bytes, write_bytes
from pcframe.kernels.checksum import reference as checksum_ref
from pcframe.kernels.copy._plan import Plan, gaps


def gather(plan: Plan, dst: torch.Tensor, zero_fill: bool) -> list:
    """Copy every piece's bytes into ``dst``; zero the uncovered bytes if ``zero_fill``."""
    for p, temp in zip(plan.pieces, plan.temps, strict=True):
        # A strided source was already staged by the plan (with read_bytes).
        src = (
            temp if temp is not None else read_bytes(p.tensor, int(p.tensor_offset), int(p.nbytes))
        )
        copy_bytes(dst[p.buffer_offset : p.buffer_offset + p.nbytes], src, non_blocking=True)
    if zero_fill:
        for start, stop in gaps(plan, dst.numel()):
            dst[start:stop].zero_()
    return []


def gather_checksum(plan: Plan, dst: torch.Tensor) -> tuple[Callable[[], int], list]:
    """Zero-filling gather; returns (thunk giving pcf64 of ``dst`` once done, keepalive)."""
    gather(plan, dst, zero_fill=True)
    return (lambda: checksum_ref.pcf64(dst.cpu().numpy())), []


def scatter(plan: Plan, src: torch.Tensor) -> list:
    """Copy buffer bytes back into every piece's tensor range."""
    for p in plan.pieces:
        chunk = src[p.buffer_offset : p.buffer_offset + p.nbytes]
        write_bytes(p.tensor, int(p.tensor_offset), chunk.to(p.tensor.device, non_blocking=True))
    return []
