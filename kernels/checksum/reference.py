"""Checksum specifications: pcf64 in plain numpy, crc32c and xxh3-64 via their libraries.

pcf64 (pcframe checksum, 64-bit, version 1) of a byte string D of length n:

1. Pad D with zero bytes to a multiple of 8 and read it as little-endian uint64 words
   w_0 .. w_{m-1}, m = ceil(n / 8).
2. For every word j (all arithmetic modulo 2**64):
       k_j = (j + 1) * 0x9E3779B97F4A7C15          (a Weyl sequence: a key per position)
       x_j = w_j XOR k_j
       c_j = (x_j mod 2**32) * (x_j >> 32) + x_j   (a 32x32->64 product, one SIMD lane op)
3. S = sum_j c_j.
4. pcf64(D) = fmix64(S XOR (n * 0xC2B2AE3D27D4EB4F + 0x27D4EB2F165667C5)), where fmix64 is
   MurmurHash3's 64-bit finalizer.

S is a sum, so any partition of the words can be hashed in parallel and the partial
sums added: that is what makes it block-parallel on GPUs and fusable into a copy.
Properties: every single-bit error is detected (the change of c_j is
+-2**k * (hi + 1) or +-2**k * (lo + 2**32), never 0 mod 2**64); the key makes moved or
swapped words and runs of equal words hash differently; the length enters the
finalizer, so trailing zero bytes change the result. It is an error-detecting code for
torn or corrupted writes, not a cryptographic hash.
"""

from __future__ import annotations

from collections.abc import Iterable

import crc32c as _crc32c
import numpy as np
import xxhash

MASK64 = (1 << 64) - 1
KEY_STEP = 0x9E3779B97F4A7C15
LEN_MUL = 0xC2B2AE3D27D4EB4F
LEN_ADD = 0x27D4EB2F165667C5

# Words processed per numpy step; bounds the temporaries at a few MiB.
_SLICE_WORDS = 1 << 18


def fmix64(z: int) -> int:
    """MurmurHash3's 64-bit finalizer (full avalanche of the accumulated sum)."""
    z ^= z >> 33
    z = (z * 0xFF51AFD7ED558CCD) & MASK64
    z ^= z >> 33
    z = (z * 0xC4CEB9FE1A85EC53) & MASK64
    z ^= z >> 33
    return z


def pcf64_finalize(total: int, nbytes: int) -> int:
    """Step 4 of pcf64: turn the word sum of ``nbytes`` bytes into the checksum."""
    return fmix64((total & MASK64) ^ ((nbytes * LEN_MUL + LEN_ADD) & MASK64))


def pcf64_word_sum(data: np.ndarray, first_word: int = 0) -> int:
    """Steps 1-3 of pcf64 over uint8 ``data`` whose first byte sits at word ``first_word``."""
    n = data.size
    pad = (-n) % 8
    if pad:
        data = np.concatenate([data, np.zeros(pad, dtype=np.uint8)])
    words = data.view("<u8")
    total = 0  # a Python int: numpy scalar arithmetic would warn on the intended wrap
    step = np.uint64(KEY_STEP)
    for start in range(0, words.size, _SLICE_WORDS):
        w = words[start : start + _SLICE_WORDS]
        j = np.arange(first_word + start + 1, first_word + start + 1 + w.size, dtype=np.uint64)
        x = w ^ (j * step)
        c = (x & np.uint64(0xFFFFFFFF)) * (x >> np.uint64(32)) + x
        total = (total + int(c.sum(dtype=np.uint64))) & MASK64
    return total


def pcf64(data: np.ndarray) -> int:
    """pcf64 checksum of a 1-D uint8 array (the specification)."""
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return pcf64_finalize(pcf64_word_sum(data), data.size)


def crc32c_buffers(buffers: Iterable[bytes | bytearray | memoryview]) -> int:
    """CRC-32C (Castagnoli) of the concatenation of ``buffers``, via the ``crc32c`` package.

    Each buffer is hashed in place (hardware-accelerated), continuing the previous value.
    """
    value = 0
    for buffer in buffers:
        value = _crc32c.crc32c(buffer, value)  # releases the GIL on large buffers
    return value


def xxh3_64_buffers(buffers: Iterable[bytes | bytearray | memoryview]) -> int:
    """XXH3-64 (seed 0) of the concatenation of ``buffers``, streamed via ``xxhash``."""
    state = xxhash.xxh3_64()
    for buffer in buffers:
        state.update(buffer)
    return state.intdigest()
