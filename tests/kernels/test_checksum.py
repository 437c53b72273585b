"""Checksums: pcf64 against its written specification, every backend against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcframe.kernels import ALGORITHMS, checksum
from pcframe.kernels.checksum import reference

from .helpers import CPU_BACKENDS, make

M64 = (1 << 64) - 1


def pcf64_by_the_book(data: bytes) -> int:
    """The pcf64 steps from the reference docstring, in plain Python ints."""
    n = len(data)
    padded = data + bytes(-n % 8)
    total = 0
    for j in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * j : 8 * j + 8], "little")
        x = w ^ (((j + 1) * 0x9E3779B97F4A7C15) & M64)
        total = (total + (x & 0xFFFFFFFF) * (x >> 32) + x) & M64
    z = total ^ ((n * 0xC2B2AE3D27D4EB4F + 0x27D4EB2F165667C5) & M64)
    z ^= z >> 33
    z = (z * 0xFF51AFD7ED558CCD) & M64
    z ^= z >> 33
    z = (z * 0xC4CEB9FE1A85EC53) & M64
    return z ^ (z >> 33)


def _bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 100])
def test_pcf64_reference_follows_its_specification(n: int) -> None:
    data = _bytes(n, seed=n)
    assert reference.pcf64(data) == pcf64_by_the_book(data.tobytes())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 4097, 20011])
def test_pcf64_backends_match_reference(backend: str, n: int) -> None:
    data = _bytes(n + 1, seed=n)
    for view in (data[:n], data[1:]):  # aligned and misaligned starts
        assert checksum(view, "pcf64", backend=backend) == reference.pcf64(view)


def test_known_values_of_library_checksums() -> None:
    assert checksum(b"123456789", "crc32c") == 0xE3069283  # the CRC-32C check value
    assert checksum(b"", "xxh3_64") == 0x2D06800538D394C2  # XXH3-64 of the empty input


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_input_kind_hashes_its_logical_bytes(algo: str) -> None:
    t = make(torch.float32, (6, 5), seed=3, strided=True)
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    want = checksum(raw, algo)
    assert checksum(t, algo) == want
    assert checksum(np.frombuffer(raw, np.uint8), algo) == want
    assert checksum(bytearray(raw), algo) == want
    assert checksum(memoryview(raw), algo) == want


def test_pcf64_detects_every_single_bit_flip() -> None:
    data = _bytes(64, seed=1)
    base = reference.pcf64(data)
    seen = {base}
    for i in range(64 * 8):
        flipped = data.copy()
        flipped[i // 8] ^= 1 << (i % 8)
        value = checksum(flipped, "pcf64", backend="numba")
        assert value not in seen
        seen.add(value)


def test_pcf64_sees_moves_zero_padding_and_zero_buffers() -> None:
    data = _bytes(64, seed=2)
    swapped = data.copy()
    swapped[:8], swapped[8:16] = data[8:16], data[:8]
    assert reference.pcf64(swapped) != reference.pcf64(data)
    assert reference.pcf64(np.append(data, np.uint8(0))) != reference.pcf64(data)
    zeros = {reference.pcf64(np.zeros(n, np.uint8)) for n in range(0, 65)}
    assert len(zeros) == 65


def test_pcf64_is_block_parallel() -> None:
    """Word sums over any split at a word boundary add up to the whole (mod 2**64)."""
    data = _bytes(8 * 1000 + 5, seed=4)
    whole = reference.pcf64_word_sum(data)
    for cut in (8, 800, 7992):
        parts = reference.pcf64_word_sum(data[:cut]) + reference.pcf64_word_sum(
            data[cut:], cut // 8
        )
        assert parts & M64 == whole


def test_library_algorithms_have_no_kernel_backends() -> None:
    with pytest.raises(ValueError, match="library"):
        checksum(b"abc", "crc32c", backend="numba")


def test_unknown_algorithm_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        checksum(b"abc", "md5")
