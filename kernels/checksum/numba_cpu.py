"""pcf64 in Numba, plus the word-hash helpers the fused copy kernels share.

The loops are written so LLVM vectorizes them: uint64 arithmetic only (Numba turns a
mix of signed and unsigned 64-bit ints into floats), the key as an induction variable,
and one accumulator (integer addition is associative, so the vectorizer may split it).
"""

from __future__ import annotations

import numba
import numpy as np

from pcframe.kernels._numba_util import NJIT, address_as_pointer
from pcframe.kernels.checksum.reference import KEY_STEP, pcf64_finalize

_STEP = np.uint64(KEY_STEP)
_LO32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


@numba.njit(**NJIT)
def hash_words(addr: int, nwords: int, first_word: int) -> np.uint64:
    """Sum of pcf64 terms c_j of ``nwords`` words at ``addr``; j starts at ``first_word``."""
    words = numba.carray(address_as_pointer(addr, np.uint64), (nwords,))
    acc = np.uint64(0)
    key = (np.uint64(first_word) + np.uint64(1)) * _STEP
    for i in range(nwords):
        x = words[i] ^ key
        acc += (x & _LO32) * (x >> _SHIFT32) + x
        key += _STEP
    return acc


@numba.njit(**NJIT)
def hash_bytes(addr: int, nbytes: int, first_word: int) -> np.uint64:
    """Like :func:`hash_words` for ``nbytes`` bytes; a ragged last word is zero-padded."""
    nwords = nbytes >> 3
    acc = hash_words(addr, nwords, first_word)
    tail = nbytes & 7
    if tail:
        rest = numba.carray(address_as_pointer(addr + 8 * nwords, np.uint8), (tail,))
        word = np.uint64(0)
        for i in range(tail):
            word |= np.uint64(rest[i]) << np.uint64(8 * i)
        x = word ^ ((np.uint64(first_word + nwords) + np.uint64(1)) * _STEP)
        acc += (x & _LO32) * (x >> _SHIFT32) + x
    return acc


def pcf64(data: np.ndarray) -> int:
    """pcf64 of a 1-D uint8 host array."""
    data = np.ascontiguousarray(data).reshape(-1)
    if data.size == 0:
        return pcf64_finalize(0, 0)
    return pcf64_finalize(int(hash_bytes(data.ctypes.data, data.size, 0)), data.size)
