"""gather / scatter / gather_checksum: every backend against independently computed bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcframe.kernels import Piece, checksum, gather, gather_checksum, scatter
from pcframe.kernels.checksum import reference as checksum_ref

from .helpers import CPU_BACKENDS, DTYPES, logical_bytes, make, pieces_in_range, same_bits

SENTINEL = 0xAB


def _tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    """Sizes around a block boundary, empty, 0-d, and two strided layouts."""
    return [
        make(dtype, (257,), seed=1),
        make(dtype, (0,), seed=2),
        make(dtype, (), seed=3),
        make(dtype, (5, 7), seed=4, strided=True),
        make(dtype, (33,), seed=5, strided=True),
        make(dtype, (3, 4, 5), seed=6),
    ]


def _layout(tensors: list[torch.Tensor], align: int = 64) -> tuple[list[tuple], int]:
    """(tensor, offset) entries at ``align``-byte offsets, and the total size."""
    entries, off = [], 0
    for t in tensors:
        entries.append((t, off))
        off += -(-(t.numel() * t.element_size()) // align) * align
    return entries, off


def _expected(entries: list[tuple], size: int, fill: int) -> np.ndarray:
    out = np.full(size, fill, dtype=np.uint8)
    for t, off in entries:
        b = logical_bytes(t)
        out[off : off + b.size] = b
    return out


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_writes_logical_bytes_and_leaves_gaps(backend: str, dtype: torch.dtype) -> None:
    entries, size = _layout(_tensors(dtype))
    dst = torch.full((size + 13,), SENTINEL, dtype=torch.uint8)
    pieces = [(t, 0, off, t.numel() * t.element_size()) for t, off in entries]
    done = gather(pieces, dst, backend=backend)
    assert done.done()
    assert np.array_equal(dst.numpy(), _expected(entries, size + 13, SENTINEL))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool], ids=str)
def test_gather_zero_fill_clears_gaps(backend: str, dtype: torch.dtype) -> None:
    entries, size = _layout(_tensors(dtype))
    dst = torch.full((size + 13,), SENTINEL, dtype=torch.uint8)
    pieces = [(t, 0, off, t.numel() * t.element_size()) for t, off in entries]
    gather(pieces, dst, backend=backend, zero_fill=True)
    assert np.array_equal(dst.numpy(), _expected(entries, size + 13, 0))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_gather_then_scatter_restores_bits(backend: str, dtype: torch.dtype) -> None:
    """Chunks of 100 bytes split elements; scatter must rebuild every tensor exactly."""
    tensors = _tensors(dtype)
    entries, size = _layout(tensors, align=8)
    chunk = 100
    flat = torch.empty(size, dtype=torch.uint8)
    for start in range(0, size, chunk):
        n = min(chunk, size - start)
        view = flat[start : start + n]
        gather(pieces_in_range(entries, start, n), view, backend=backend, zero_fill=True)
    assert np.array_equal(flat.numpy(), _expected(entries, size, 0))
    # Fresh targets, the multi-dimensional ones strided (the restore-into-a-view case).
    targets = [
        torch.empty((t.shape[-1], *t.shape[:-1]), dtype=dtype).movedim(0, -1)
        if t.dim() >= 2
        else torch.empty_like(t)
        for t in tensors
    ]
    out_entries = [(tt, off) for tt, (_, off) in zip(targets, entries, strict=True)]
    for start in range(0, size, chunk):
        n = min(chunk, size - start)
        scatter(flat[start : start + n], pieces_in_range(out_entries, start, n), backend=backend)
    for got, want in zip(targets, tensors, strict=True):
        assert same_bits(got, want)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gather_checksum_is_checksum_of_written_buffer(backend: str) -> None:
    """Odd offsets and lengths: words straddle pieces and gaps."""
    a = make(torch.float32, (300,), seed=7)
    b = make(torch.int16, (37,), seed=8)
    c = make(torch.float64, (9, 3), seed=9, strided=True)
    pieces = [
        Piece(a, 4, 3, 1001),
        Piece(b, 1, 1011, 70),
        Piece(c, 8, 1090, 200),
        Piece(a, 0, 1300, 0),
    ]
    dst = torch.full((1405,), SENTINEL, dtype=torch.uint8)
    value = gather_checksum(pieces, dst, backend=backend).result()
    expected = np.zeros(1405, dtype=np.uint8)
    for p in pieces:
        expected[p.buffer_offset : p.buffer_offset + p.nbytes] = logical_bytes(p.tensor)[
            p.tensor_offset : p.tensor_offset + p.nbytes
        ]
    assert np.array_equal(dst.numpy(), expected)
    assert value == checksum_ref.pcf64(expected)
    assert value == checksum(dst, "pcf64", backend="torch")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gather_checksum_of_empty_and_uncovered_buffers(backend: str) -> None:
    empty = torch.empty(0, dtype=torch.uint8)
    assert gather_checksum([], empty, backend=backend).result() == checksum_ref.pcf64(
        np.zeros(0, np.uint8)
    )
    dst = torch.full((77,), SENTINEL, dtype=torch.uint8)
    value = gather_checksum([], dst, backend=backend).result()
    assert not dst.any()
    assert value == checksum_ref.pcf64(np.zeros(77, np.uint8))


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        ([(torch.zeros(4), 0, 0, 16), (torch.zeros(4), 0, 8, 16)], "overlap"),
        ([(torch.zeros(4), 4, 0, 16)], "exceeds its tensor"),
        ([(torch.zeros(40), 0, 60, 16)], "exceeds the buffer"),
        ([(torch.zeros(4), -1, 0, 4)], "negative offset"),
        ([(torch.zeros(4), 0.5, 0, 4)], "non-negative int"),
        ([("not a tensor", 0, 0, 4)], "torch.Tensor"),
    ],
)
def test_gather_rejects_bad_pieces(pieces: list, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        gather(pieces, torch.zeros(64, dtype=torch.uint8), backend="numba")


def test_gather_rejects_bad_buffer() -> None:
    with pytest.raises(ValueError, match="uint8"):
        gather([], torch.zeros(64, dtype=torch.int8))
    with pytest.raises(ValueError, match="contiguous"):
        gather([], torch.zeros(64, dtype=torch.uint8)[::2])


def test_scatter_into_strided_tensor_keeps_untouched_bytes() -> None:
    """A partial piece into a strided tensor rewrites only its own bytes."""
    target = torch.arange(12, dtype=torch.int32).view(3, 4).t()
    before = target.clone()
    src = torch.full((6,), 0xFF, dtype=torch.uint8)
    scatter(src, [(target, 5, 0, 6)], backend="numba")
    got = logical_bytes(target)
    want = logical_bytes(before)
    want[5:11] = 0xFF
    assert np.array_equal(got, want)


def test_triton_launcher_rejects_pageable_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from pcframe.kernels.copy import triton_gpu

    monkeypatch.setattr(triton_gpu, "triton_interpreting", lambda: False)
    with pytest.raises(ValueError, match="pin_memory"):
        triton_gpu.check_memory(torch.zeros(4), "the buffer")


def test_gather_same_result_for_all_backends_on_many_small_pieces() -> None:
    """Hundreds of tiny tensors in one call (the many-biases case)."""
    ts = [make(torch.float16, (i % 9,), seed=i) for i in range(300)]
    entries, size = _layout(ts, align=16)
    pieces = [(t, 0, off, t.numel() * 2) for t, off in entries]
    outs = []
    for backend in ("torch", "numba"):
        dst = torch.full((size,), SENTINEL, dtype=torch.uint8)
        outs.append(gather_checksum(pieces, dst, backend=backend).result())
        assert np.array_equal(dst.numpy(), _expected(entries, size, 0))
    assert outs[0] == outs[1]


def test_copy_bytes_in_words_equals_copy_for_every_alignment_and_strided_sources():
    from pcframe.kernels._tensor_bytes import copy_bytes

    base = torch.arange(256, dtype=torch.uint8)
    for start in range(9):
        for length in (0, 1, 7, 8, 9, 63, 64, 65):
            for dst_start in (0, 3, 8):
                dst = torch.zeros(256, dtype=torch.uint8)
                expected = dst.clone()
                expected[dst_start : dst_start + length] = base[start : start + length]
                copy_bytes(dst[dst_start : dst_start + length], base[start : start + length])
                assert torch.equal(dst, expected), (start, length, dst_start)
    strided = base[::2][:40]  # not contiguous: copied element by element
    dst = torch.zeros(40, dtype=torch.uint8)
    copy_bytes(dst, strided)
    assert torch.equal(dst, strided)
