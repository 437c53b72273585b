"""Numba building blocks: raw-address arrays, memcpy and memset.

Kernels take plain ``int64`` addresses so one compiled signature serves every dtype and
every number of tensors (no typed lists, no per-tensor reflection). ``memcpy`` and
``memset`` lower to the LLVM intrinsics, i.e. to libc's tuned routines, and unlike a
ctypes function pointer they keep the functions cacheable (``cache=True``).
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# Every kernel releases the GIL so writer threads run truly concurrently, and is cached
# on disk so a restart does not pay the compile time again.
NJIT = {"nogil": True, "cache": True}


@intrinsic
def address_as_pointer(typingctx, addr, dtype):
    """``(int64 address, numpy scalar type) -> typed pointer``, for ``numba.carray``."""
    if not isinstance(addr, types.Integer) or not isinstance(dtype, types.NumberClass):
        return None
    ptr_type = types.CPointer(dtype.instance_type)
    sig = ptr_type(addr, dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_type))

    return sig, codegen


@intrinsic
def memcpy(typingctx, dst_addr, src_addr, nbytes):
    """Copy ``nbytes`` from ``src_addr`` to ``dst_addr`` (regions must not overlap)."""
    sig = types.void(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        dst, src, n = args
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(dst, i8p), builder.inttoptr(src, i8p), n, 1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def memset0(typingctx, dst_addr, nbytes):
    """Zero ``nbytes`` bytes at ``dst_addr``."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        dst, n = args
        i8p = ir.IntType(8).as_pointer()
        cgutils.memset(builder, builder.inttoptr(dst, i8p), n, 0)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def f32_bits(typingctx, value):
    """Bit pattern of a float32 as uint32 (a register bitcast, vectorizable)."""
    if value != types.float32:
        return None
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def bits_f32(typingctx, bits):
    """float32 whose bit pattern is the low 32 bits of an integer (Numba widens uint32
    arithmetic to 64 bits, so any integer width is accepted)."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        value = args[0]
        width = signature.args[0].bitwidth
        if width > 32:
            value = builder.trunc(value, ir.IntType(32))
        elif width < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return sig, codegen


__all__ = ["NJIT", "address_as_pointer", "bits_f32", "f32_bits", "memcpy", "memset0", "numba"]
