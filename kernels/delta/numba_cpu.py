"""XOR delta with Numba: uint64 words, then the ragged tail bytewise."""

from __future__ import annotations

import numba
import numpy as np
import torch

from pcframe.kernels._numba_util import NJIT, address_as_pointer


@numba.njit(**NJIT)
def xor_into(a_addr: int, b_addr: int, out_addr: int, nbytes: int) -> None:
    """``out = a XOR b`` over ``nbytes`` bytes at raw addresses (``out`` may alias ``a``)."""
    nwords = nbytes >> 3
    a64 = numba.carray(address_as_pointer(a_addr, np.uint64), (nwords,))
    b64 = numba.carray(address_as_pointer(b_addr, np.uint64), (nwords,))
    o64 = numba.carray(address_as_pointer(out_addr, np.uint64), (nwords,))
    for i in range(nwords):
        o64[i] = a64[i] ^ b64[i]
    a8 = numba.carray(address_as_pointer(a_addr, np.uint8), (nbytes,))
    b8 = numba.carray(address_as_pointer(b_addr, np.uint8), (nbytes,))
    o8 = numba.carray(address_as_pointer(out_addr, np.uint8), (nbytes,))
    for i in range(nwords * 8, nbytes):
        o8[i] = a8[i] ^ b8[i]


def xor_bytes(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a XOR b`` for 1-D uint8 CPU tensors of equal length."""
    if out.numel():
        xor_into(a.data_ptr(), b.data_ptr(), out.data_ptr(), out.numel())
