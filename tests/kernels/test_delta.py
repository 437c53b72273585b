"""XOR delta: exact inversion for every dtype, every backend equal to the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcframe.kernels import decode_delta, encode_delta

from .helpers import CPU_BACKENDS, DTYPES, logical_bytes, make, same_bits


def _versions(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A previous version and a current one with every third element and specials changed."""
    prev = make(dtype, shape, seed=1)
    cur = prev.clone().reshape(-1)
    cur[::3] = make(dtype, (len(range(0, cur.numel(), 3)),), seed=2)
    if dtype.is_floating_point and cur.numel() > 4:
        cur[:3] = torch.tensor([float("nan"), -0.0, float("inf")], dtype=dtype)
    return cur.view(shape), prev


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (1,), (1001,), (3, 5, 7)])
def test_delta_roundtrip_is_bit_exact(backend: str, dtype: torch.dtype, shape: tuple) -> None:
    cur, prev = _versions(dtype, shape)
    delta = encode_delta(cur, prev, backend=backend)
    assert delta.dtype == torch.uint8 and delta.numel() == cur.numel() * cur.element_size()
    assert np.array_equal(delta.numpy(), logical_bytes(cur) ^ logical_bytes(prev))
    assert same_bits(decode_delta(delta, prev, backend=backend), cur)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_delta_of_strided_versions_and_in_place_decode(backend: str) -> None:
    prev = make(torch.float32, (9, 13), seed=3, strided=True)
    cur = prev * 1.5
    delta = encode_delta(cur, prev, backend=backend)
    assert np.array_equal(delta.numpy(), logical_bytes(cur) ^ logical_bytes(prev))
    target = prev.contiguous()
    assert decode_delta(delta.numpy().tobytes(), target, backend=backend, out=target) is target
    assert same_bits(target, cur)
    strided_out = torch.empty(13, 9).t()
    assert same_bits(decode_delta(delta, prev, backend=backend, out=strided_out), cur)


def test_unchanged_tensor_gives_all_zero_delta() -> None:
    t = make(torch.bfloat16, (500,), seed=4)
    assert not encode_delta(t, t.clone()).any()


def test_mismatched_versions_are_rejected() -> None:
    with pytest.raises(ValueError, match="same dtype and shape"):
        encode_delta(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="same dtype and shape"):
        encode_delta(torch.zeros(4), torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="bytes"):
        decode_delta(torch.zeros(15, dtype=torch.uint8), torch.zeros(4))


def test_encode_into_a_reused_buffer() -> None:
    prev = make(torch.float16, (100,), seed=5)
    cur = make(torch.float16, (100,), seed=6)
    buf = torch.full((200,), 7, dtype=torch.uint8)
    assert encode_delta(cur, prev, out=buf) is buf
    assert np.array_equal(buf.numpy(), logical_bytes(cur) ^ logical_bytes(prev))
    with pytest.raises(ValueError, match="200 bytes"):
        encode_delta(cur, prev, out=torch.empty(199, dtype=torch.uint8))
