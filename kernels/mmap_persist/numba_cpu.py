"""Persist into a mapped region with Numba: copy and pcf64 in one pass over the chunk.

The chunk is copied in L1-sized sub-blocks and each sub-block is hashed right after it
lands, from cache, so the mapped pages are written once and never read back from
memory (on persistent memory a read-back would cost a media read).
"""

from __future__ import annotations

import numba
import numpy as np

from pcframe.kernels._numba_util import NJIT, memcpy
from pcframe.kernels.checksum import checksum
from pcframe.kernels.checksum import reference as checksum_ref
from pcframe.kernels.checksum.numba_cpu import hash_bytes, hash_words

_SUB_BYTES = 16384


@numba.njit(**NJIT)
def copy_pcf64(dst: int, src: int, nbytes: int) -> np.uint64:
    """``memcpy(dst, src, nbytes)`` returning the pcf64 word sum of the bytes."""
    acc = np.uint64(0)
    done = 0
    while done + _SUB_BYTES <= nbytes:
        memcpy(dst + done, src + done, _SUB_BYTES)
        acc += hash_words(dst + done, _SUB_BYTES >> 3, done >> 3)
        done += _SUB_BYTES
    memcpy(dst + done, src + done, nbytes - done)
    acc += hash_bytes(dst + done, nbytes - done, done >> 3)
    return acc


@numba.njit(**NJIT)
def copy_only(dst: int, src: int, nbytes: int) -> None:
    """``memcpy`` with the GIL released."""
    memcpy(dst, src, nbytes)


def persist(region: np.ndarray, offset: int, chunk: np.ndarray, algo: str) -> int:
    """Copy ``chunk`` into ``region`` at ``offset``; return its ``algo`` checksum."""
    n = chunk.size
    dst = region.ctypes.data + offset
    if algo == "pcf64":
        return checksum_ref.pcf64_finalize(int(copy_pcf64(dst, chunk.ctypes.data, n)), n)
    copy_only(dst, chunk.ctypes.data, n)
    # crc32c / xxh3 come from their libraries: a second pass, over the (cached) source.
    return checksum(chunk, algo)
