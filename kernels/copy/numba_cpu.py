"""Gather / scatter on CPU with Numba: libc memcpy per piece, no Python per piece.

The fused gather + pcf64 copies each piece in L1-sized sub-blocks and hashes every
sub-block right after copying it, while it is still in cache: memory is read once and
written once, as in a plain memcpy, and the hash costs only cache bandwidth. Words that
straddle two pieces or a gap are hashed once both sides are written.

Kernels are serial on purpose: the engine runs one call per chunk on several writer
threads, and with ``nogil`` those calls run in parallel without a threading layer
(``parallel=True`` would oversubscribe the cores, and Numba's default ``workqueue``
layer aborts on concurrent calls from several threads).
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import torch

from pcframe.kernels._numba_util import NJIT, memcpy, memset0
from pcframe.kernels.checksum.numba_cpu import hash_bytes, hash_words
from pcframe.kernels.checksum.reference import pcf64_finalize
from pcframe.kernels.copy._plan import Plan

# Sub-block of the fused copy: well inside L1d (32-48 KiB) with room for the source.
_SUB_BYTES = 16384


@numba.njit(**NJIT)
def copy_ranges(src_addr: np.ndarray, dst_addr: np.ndarray, nbytes: np.ndarray) -> None:
    """``memcpy(dst_addr[i], src_addr[i], nbytes[i])`` for every i."""
    for i in range(src_addr.shape[0]):
        memcpy(dst_addr[i], src_addr[i], nbytes[i])


@numba.njit(**NJIT)
def zero_gaps(dst: int, dst_len: int, starts: np.ndarray, nbytes: np.ndarray) -> None:
    """Zero the bytes of ``[dst, dst + dst_len)`` outside the sorted ranges."""
    pos = 0
    for i in range(starts.shape[0]):
        if starts[i] > pos:
            memset0(dst + pos, starts[i] - pos)
        pos = starts[i] + nbytes[i]
    if dst_len > pos:
        memset0(dst + pos, dst_len - pos)


@numba.njit(**NJIT)
def gather_pcf64(
    src_addr: np.ndarray, starts: np.ndarray, nbytes: np.ndarray, dst: int, dst_len: int
) -> np.uint64:
    """Zero-filling gather into ``dst``; returns the pcf64 word sum of all ``dst_len`` bytes.

    Pieces must be sorted by ``starts`` and must not overlap.
    """
    acc = np.uint64(0)
    pos = 0  # bytes [0, pos) of dst are written
    hashed = 0  # bytes [0, hashed) are hashed; always a multiple of 8
    for i in range(src_addr.shape[0]):
        if starts[i] > pos:
            memset0(dst + pos, starts[i] - pos)
            pos = starts[i]
        done = 0
        while done < nbytes[i]:
            step = min(_SUB_BYTES, nbytes[i] - done)
            memcpy(dst + pos, src_addr[i] + done, step)
            pos += step
            done += step
            whole = pos & ~7
            if whole > hashed:
                acc += hash_words(dst + hashed, (whole - hashed) >> 3, hashed >> 3)
                hashed = whole
    if dst_len > pos:
        memset0(dst + pos, dst_len - pos)
    acc += hash_bytes(dst + hashed, dst_len - hashed, hashed >> 3)
    return acc


def gather(plan: Plan, dst: torch.Tensor, zero_fill: bool) -> list:
    """Copy the planned pieces into the 1-D uint8 CPU tensor ``dst``."""
    base = dst.data_ptr()
    if len(plan):
        copy_ranges(plan.tensor_addr, base + plan.buffer_offset, plan.nbytes)
    if zero_fill:
        zero_gaps(base, dst.numel(), plan.buffer_offset, plan.nbytes)
    return []


def gather_checksum(plan: Plan, dst: torch.Tensor) -> tuple[Callable[[], int], list]:
    """Zero-filling gather fused with pcf64 of the whole of ``dst``."""
    n = dst.numel()
    total = int(gather_pcf64(plan.tensor_addr, plan.buffer_offset, plan.nbytes, dst.data_ptr(), n))
    value = pcf64_finalize(total, n)
    return (lambda: value), []


def scatter(plan: Plan, src: torch.Tensor) -> list:
    """Copy ranges of the 1-D uint8 CPU tensor ``src`` back into the planned pieces."""
    if len(plan):
        copy_ranges(src.data_ptr() + plan.buffer_offset, plan.tensor_addr, plan.nbytes)
    plan.finish_scatter()
    return []
