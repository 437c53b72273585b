"""Byte shuffle + zstd: the shuffle layout, backends against the reference, round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcframe.kernels import ShuffleZstd, shuffle_bytes, unshuffle_bytes

from .helpers import CPU_BACKENDS, DTYPES, logical_bytes, make, same_bits


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "strided"), [((0,), False), ((1,), False), ((4097,), False), ((5, 9), True)]
)
def test_shuffle_layout_and_inverse(backend, dtype, shape, strided) -> None:
    x = make(dtype, shape, seed=len(shape), strided=strided)
    size = x.element_size()
    planes = logical_bytes(x).reshape(-1, size).T.reshape(-1)  # byte k of every element, in turn
    s = shuffle_bytes(x, backend=backend)
    assert np.array_equal(s.numpy(), planes)
    assert np.array_equal(unshuffle_bytes(s, size, backend=backend).numpy(), logical_bytes(x))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_shuffle_of_raw_bytes_with_explicit_itemsize(backend: str) -> None:
    raw = torch.arange(24, dtype=torch.uint8)
    want = raw.view(-1, 8).t().reshape(-1)
    assert torch.equal(shuffle_bytes(raw, 8, backend=backend), want)
    assert torch.equal(
        shuffle_bytes(raw[1:17], 4, backend=backend), raw[1:17].view(-1, 4).t().reshape(-1)
    )
    with pytest.raises(ValueError, match="whole number"):
        shuffle_bytes(raw[:10], 4, backend=backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "strided"), [((0,), False), ((), False), ((300,), False), ((6, 7), True)]
)
def test_shuffle_zstd_roundtrip_is_bit_exact(dtype, shape, strided) -> None:
    x = make(dtype, shape, seed=3, strided=strided)
    codec = ShuffleZstd(level=1)
    back = codec.decompress(codec.compress(x), dtype, shape)
    assert same_bits(back, x)


def test_shuffle_makes_float_data_compress_better() -> None:
    x = (1.0 + torch.rand(1 << 16) * 1e-2).float()  # sign and exponent bytes nearly constant
    shuffled = len(ShuffleZstd(level=3).compress(x))
    plain = len(ShuffleZstd(level=3, shuffle=False).compress(x))
    assert shuffled < 0.9 * plain
    assert shuffled < 0.8 * x.numel() * 4


def test_truncated_or_oversized_payload_is_rejected() -> None:
    codec = ShuffleZstd()
    payload = codec.compress(torch.arange(100, dtype=torch.int32))
    with pytest.raises(ValueError, match="exactly"):
        codec.decompress(payload, torch.int32, (99,))
    with pytest.raises(ValueError, match="exactly"):
        codec.decompress(payload, torch.int32, (101,))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_shuffle_into_reused_buffers(backend: str) -> None:
    x = make(torch.float64, (50,), seed=9)
    buf = torch.full((400,), 7, dtype=torch.uint8)
    assert shuffle_bytes(x, backend=backend, out=buf) is buf
    back = torch.zeros(400, dtype=torch.uint8)
    assert unshuffle_bytes(buf, 8, backend=backend, out=back) is back
    assert np.array_equal(back.numpy(), logical_bytes(x))
    with pytest.raises(ValueError, match="400 bytes"):
        shuffle_bytes(x, backend=backend, out=torch.empty(399, dtype=torch.uint8))
