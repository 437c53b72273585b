"""Gather / scatter in Triton: many tensors in one launch through address tables.

Sources are addressed by raw int64 pointers (like apex's multi-tensor apply), so any
number of tensors of any dtype costs one launch. Two kernels:

* ``_copy_tiles_kernel`` copies (src, dst, len) tiles: plain gather and scatter. Tiles
  whose ends are 8-byte aligned move uint64 words, the rest bytes.
* ``_gather_blocks_kernel`` is destination-centric: each program owns one block of the
  buffer, pulls in the bytes of every piece overlapping it, zero-fills the rest, writes
  the block as uint64 words and, fused, adds its pcf64 terms. The destination (pinned
  host memory during a snapshot) is written exactly once, in wide stores, and never
  read back over PCIe.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from pcframe.kernels.checksum.reference import pcf64_finalize
from pcframe.kernels.checksum.triton_gpu import pcf64_terms, sum_partials
from pcframe.kernels.copy._plan import Plan
from pcframe.kernels.dispatch import triton_interpreting

TILE_BYTES = 16384
BLOCK_WORDS = 512


@triton.jit
def _copy_tiles_kernel(tiles_ptr, TILE: tl.constexpr, WIDE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    src = tl.load(tiles_ptr + 3 * t)
    dst = tl.load(tiles_ptr + 3 * t + 1)
    nbytes = tl.load(tiles_ptr + 3 * t + 2)
    offs = tl.arange(0, TILE)
    if WIDE:
        mask = offs < nbytes // 8
        v = tl.load(src.to(tl.pointer_type(tl.uint64)) + offs, mask=mask)
        tl.store(dst.to(tl.pointer_type(tl.uint64)) + offs, v, mask=mask)
    else:
        mask = offs < nbytes
        v = tl.load(src.to(tl.pointer_type(tl.uint8)) + offs, mask=mask)
        tl.store(dst.to(tl.pointer_type(tl.uint8)) + offs, v, mask=mask)


@triton.jit
def _gather_blocks_kernel(
    pieces_ptr,
    spans_ptr,
    dst_addr,
    dst_len,
    partial_ptr,
    BLOCK_WORDS: tl.constexpr,
    WORD_STORES: tl.constexpr,
    HASH: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    w = pid * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    pos = w[:, None] * 8 + tl.arange(0, 8)[None, :]
    vals = tl.zeros([BLOCK_WORDS, 8], dtype=tl.uint8)
    first = tl.load(spans_ptr + 2 * pid)
    stop = tl.load(spans_ptr + 2 * pid + 1)
    for p in range(first, stop):
        src = tl.load(pieces_ptr + 3 * p)
        start = tl.load(pieces_ptr + 3 * p + 1)
        nbytes = tl.load(pieces_ptr + 3 * p + 2)
        inside = (pos >= start) & (pos < start + nbytes)
        v = tl.load(src.to(tl.pointer_type(tl.uint8)) + (pos - start), mask=inside, other=0)
        vals = tl.where(inside, v, vals)
    shift = (tl.arange(0, 8).to(tl.uint64) * 8)[None, :]
    words = tl.sum(vals.to(tl.uint64) << shift, axis=1)
    dst8 = dst_addr.to(tl.pointer_type(tl.uint8))
    if WORD_STORES:
        whole = (w + 1) * 8 <= dst_len
        tl.store(dst_addr.to(tl.pointer_type(tl.uint64)) + w, words, mask=whole)
        tl.store(dst8 + pos, vals, mask=(pos < dst_len) & ~whole[:, None])
    else:
        tl.store(dst8 + pos, vals, mask=pos < dst_len)
    if HASH:
        terms = tl.where(w * 8 < dst_len, pcf64_terms(words, w.to(tl.uint64)), 0)
        tl.store(partial_ptr + pid, tl.sum(terms, axis=0).to(tl.int64, bitcast=True))


def check_memory(t: torch.Tensor, what: str) -> None:
    """Triton kernels can touch CUDA memory and pinned host memory (not pageable memory)."""
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and triton_interpreting():
        return
    if t.device.type == "cpu" and t.is_pinned():
        return
    raise ValueError(
        f"{what} is in {'pageable host' if t.device.type == 'cpu' else t.device.type} memory; "
        "the triton backend needs CUDA tensors or pinned host memory (tensor.pin_memory())"
    )


def _table(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 table where the kernel can read it (uploaded asynchronously to CUDA)."""
    host = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64).reshape(-1))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _tiles(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, tile: int) -> np.ndarray:
    """Cut ``(src, dst, nbytes)`` ranges into rows of at most ``tile`` bytes."""
    counts = -(-nbytes // tile)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    within = (np.arange(counts.sum()) - first) * tile
    idx = np.repeat(np.arange(nbytes.size), counts)
    lengths = np.minimum(nbytes[idx] - within, tile)
    return np.stack([src[idx] + within, dst[idx] + within, lengths], axis=1)


def copy_ranges(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, device: torch.device) -> list:
    """Launch the tile kernel for ``(src, dst, nbytes)`` ranges; returns tables to keep alive."""
    keep = []
    # 8-byte aligned ranges move as words; their ragged tails and the rest move as bytes.
    wide = ((src % 8) == 0) & ((dst % 8) == 0)
    body = np.where(wide, nbytes - nbytes % 8, 0)
    parts = [
        (True, src, dst, body),
        (False, src + body, dst + body, nbytes - body),
    ]
    for is_wide, s, d, n in parts:
        keep_rows = n > 0
        if not keep_rows.any():
            continue
        tiles = _tiles(s[keep_rows], d[keep_rows], n[keep_rows], TILE_BYTES)
        table = _table(tiles, device)
        tile = TILE_BYTES // 8 if is_wide else TILE_BYTES
        _copy_tiles_kernel[(tiles.shape[0],)](table, TILE=tile, WIDE=is_wide)
        keep.append(table)
    return keep


def _device_of(plan: Plan, buffer: torch.Tensor) -> torch.device:
    for t in [buffer, *(p.tensor for p in plan.pieces)]:
        if t.device.type == "cuda":
            return t.device
    return buffer.device


def _check(plan: Plan, buffer: torch.Tensor) -> None:
    check_memory(buffer, "the buffer")
    for p, temp in zip(plan.pieces, plan.temps, strict=True):
        check_memory(p.tensor if temp is None else temp, "a piece tensor")


def _gather_blocks(plan: Plan, dst: torch.Tensor, hash_: bool) -> tuple[torch.Tensor, list]:
    device = _device_of(plan, dst)
    n = dst.numel()
    block_bytes = BLOCK_WORDS * 8
    blocks = max(1, triton.cdiv(n, block_bytes))
    starts = plan.buffer_offset
    block_starts = np.arange(blocks, dtype=np.int64) * block_bytes
    # Pieces are sorted and disjoint, so their ends are sorted too.
    first = np.searchsorted(starts + plan.nbytes, block_starts, side="right")
    stop = np.searchsorted(starts, block_starts + block_bytes, side="left")
    pieces = _table(np.stack([plan.tensor_addr, starts, plan.nbytes], axis=1), device)
    spans = _table(np.stack([first, stop], axis=1), device)
    partials = torch.zeros(blocks, dtype=torch.int64, device=device)
    if n == 0:
        return partials, []
    _gather_blocks_kernel[(blocks,)](
        pieces,
        spans,
        dst.data_ptr(),
        n,
        partials,
        BLOCK_WORDS=BLOCK_WORDS,
        WORD_STORES=dst.data_ptr() % 8 == 0,
        HASH=hash_,
    )
    return partials, [pieces, spans, partials]


def gather(plan: Plan, dst: torch.Tensor, zero_fill: bool) -> list:
    """Launch the gather on the current stream; returns objects to keep alive until done."""
    _check(plan, dst)
    if zero_fill:
        return _gather_blocks(plan, dst, hash_=False)[1]
    if not len(plan):
        return []
    return copy_ranges(
        plan.tensor_addr, dst.data_ptr() + plan.buffer_offset, plan.nbytes, _device_of(plan, dst)
    )


def gather_checksum(plan: Plan, dst: torch.Tensor) -> tuple[Callable[[], int], list]:
    """Fused zero-filling gather + pcf64; returns (value thunk, objects to keep alive)."""
    _check(plan, dst)
    partials, keep = _gather_blocks(plan, dst, hash_=True)
    n = dst.numel()
    return (lambda: pcf64_finalize(sum_partials(partials), n)), keep


def scatter(plan: Plan, src: torch.Tensor) -> list:
    """Launch the scatter of ``src`` ranges into the planned pieces."""
    _check(plan, src)
    keep = []
    if len(plan):
        keep = copy_ranges(
            src.data_ptr() + plan.buffer_offset,
            plan.tensor_addr,
            plan.nbytes,
            _device_of(plan, src),
        )
    plan.finish_scatter()
    return keep
