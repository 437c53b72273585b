"""Byte shuffle with Numba: one word load per element, one byte store per plane.

Itemsizes 2, 4 and 8 read whole words and peel the bytes off with shifts into the
``itemsize`` output planes, all in one sequential pass that LLVM vectorizes; other
itemsizes use a byte loop over cache-sized runs of elements.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from pcframe.kernels._numba_util import NJIT, address_as_pointer

_RUN = 4096  # elements per run: the run's source bytes stay in L1


@numba.njit(**NJIT)
def shuffle_into(src_addr: int, dst_addr: int, n: int, itemsize: int) -> None:
    """``dst[k * n + i] = src[i * itemsize + k]``."""
    dst = numba.carray(address_as_pointer(dst_addr, np.uint8), (n * itemsize,))
    if itemsize == 8:
        s8 = numba.carray(address_as_pointer(src_addr, np.uint64), (n,))
        p0, p1, p2, p3 = dst[0:n], dst[n : 2 * n], dst[2 * n : 3 * n], dst[3 * n : 4 * n]
        p4, p5, p6, p7 = dst[4 * n : 5 * n], dst[5 * n : 6 * n], dst[6 * n : 7 * n], dst[7 * n :]
        for i in range(n):
            w = s8[i]
            p0[i] = np.uint8(w)
            p1[i] = np.uint8(w >> np.uint64(8))
            p2[i] = np.uint8(w >> np.uint64(16))
            p3[i] = np.uint8(w >> np.uint64(24))
            p4[i] = np.uint8(w >> np.uint64(32))
            p5[i] = np.uint8(w >> np.uint64(40))
            p6[i] = np.uint8(w >> np.uint64(48))
            p7[i] = np.uint8(w >> np.uint64(56))
    elif itemsize == 4:
        s4 = numba.carray(address_as_pointer(src_addr, np.uint32), (n,))
        p0, p1, p2, p3 = dst[0:n], dst[n : 2 * n], dst[2 * n : 3 * n], dst[3 * n :]
        for i in range(n):
            w = s4[i]
            p0[i] = np.uint8(w)
            p1[i] = np.uint8(w >> np.uint32(8))
            p2[i] = np.uint8(w >> np.uint32(16))
            p3[i] = np.uint8(w >> np.uint32(24))
    elif itemsize == 2:
        s2 = numba.carray(address_as_pointer(src_addr, np.uint16), (n,))
        p0, p1 = dst[0:n], dst[n:]
        for i in range(n):
            w = s2[i]
            p0[i] = np.uint8(w)
            p1[i] = np.uint8(w >> np.uint16(8))
    else:
        src = numba.carray(address_as_pointer(src_addr, np.uint8), (n * itemsize,))
        for i0 in range(0, n, _RUN):
            for k in range(itemsize):
                for i in range(i0, min(i0 + _RUN, n)):
                    dst[k * n + i] = src[i * itemsize + k]


@numba.njit(**NJIT)
def unshuffle_into(src_addr: int, dst_addr: int, n: int, itemsize: int) -> None:
    """``dst[i * itemsize + k] = src[k * n + i]``."""
    src = numba.carray(address_as_pointer(src_addr, np.uint8), (n * itemsize,))
    if itemsize == 8:
        d8 = numba.carray(address_as_pointer(dst_addr, np.uint64), (n,))
        for i in range(n):
            w = np.uint64(0)
            for k in range(8):
                w |= np.uint64(src[k * n + i]) << np.uint64(8 * k)
            d8[i] = w
    elif itemsize == 4:
        d4 = numba.carray(address_as_pointer(dst_addr, np.uint32), (n,))
        for i in range(n):
            d4[i] = (
                np.uint32(src[i])
                | (np.uint32(src[n + i]) << np.uint32(8))
                | (np.uint32(src[2 * n + i]) << np.uint32(16))
                | (np.uint32(src[3 * n + i]) << np.uint32(24))
            )
    elif itemsize == 2:
        d2 = numba.carray(address_as_pointer(dst_addr, np.uint16), (n,))
        for i in range(n):
            d2[i] = np.uint16(src[i]) | (np.uint16(src[n + i]) << np.uint16(8))
    else:
        dst = numba.carray(address_as_pointer(dst_addr, np.uint8), (n * itemsize,))
        for i0 in range(0, n, _RUN):
            for k in range(itemsize):
                for i in range(i0, min(i0 + _RUN, n)):
                    dst[i * itemsize + k] = src[k * n + i]


def _aligned(t: torch.Tensor, itemsize: int) -> bool:
    return t.data_ptr() % itemsize == 0


def shuffle(data: torch.Tensor, itemsize: int, out: torch.Tensor) -> None:
    """Shuffle flat uint8 CPU ``data`` holding elements of ``itemsize`` bytes into ``out``."""
    n = data.numel() // itemsize
    if n:
        # Word loads want element alignment; an odd view goes through an aligned copy.
        src = data if _aligned(data, itemsize) else data.clone()
        shuffle_into(src.data_ptr(), out.data_ptr(), n, itemsize)


def unshuffle(data: torch.Tensor, itemsize: int, out: torch.Tensor) -> None:
    """Inverse of :func:`shuffle`."""
    n = data.numel() // itemsize
    if n:
        dst = out if _aligned(out, itemsize) else torch.empty_like(out)
        unshuffle_into(data.data_ptr(), dst.data_ptr(), n, itemsize)
        if dst is not out:
            out.copy_(dst)
