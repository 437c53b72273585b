"""The lossless codecs: raw bytes, shuffle + zstd, XOR delta against the previous version."""

from __future__ import annotations

from typing import Any

import torch

from pcframe.kernels._tensor_bytes import as_uint8_array, byte_view, tensor_nbytes
from pcframe.kernels.codecs.base import Codec, host_bytes, register_codec
from pcframe.kernels.codecs.meta import (
    check_zstd_meta,
    meta_equal,
    meta_flag,
    numel_of,
    require,
)
from pcframe.kernels.delta import decode_delta, encode_delta
from pcframe.kernels.dtypes import dtype_name
from pcframe.kernels.lossless import ShuffleZstd


@register_codec
class RawCodec(Codec):
    """The logical bytes as they are (bit-exact; zero-copy for contiguous CPU tensors)."""

    name = "raw"
    lossless = True

    def _encode(self, tensor, previous):
        return host_bytes(tensor).numpy(), {"nbytes": tensor_nbytes(tensor)}

    def _check_meta(self, meta, dtype, shape, itemsize, payload_nbytes):
        expected = numel_of(shape) * itemsize
        nbytes = require(meta, "nbytes", self.name)
        if payload_nbytes != expected or type(nbytes) is not int or nbytes != expected:
            raise ValueError(
                f"raw payload has {payload_nbytes} bytes (meta nbytes {nbytes!r:.40}), "
                f"{dtype_name(dtype)}{shape} needs {expected}"
            )

    def _decode(self, payload, meta, dtype, shape, previous, out):
        data = as_uint8_array(payload)
        if out is not None and out.is_contiguous() and out.device.type == "cpu":
            byte_view(out).numpy()[:] = data
            return out
        result = torch.empty(shape, dtype=dtype)
        byte_view(result).numpy()[:] = data
        return result


@register_codec
class ZstdCodec(Codec):
    """Byte shuffle + zstd, lossless."""

    name = "zstd"
    lossless = True

    def __init__(self, level: int = 3, *, shuffle: bool = True, threads: int = 0) -> None:
        self._zstd = ShuffleZstd(level, shuffle=shuffle, threads=threads)

    def config(self) -> dict[str, Any]:
        return {
            "level": self._zstd.level,
            "shuffle": self._zstd.shuffle,
            "threads": self._zstd.threads,
        }

    def _encode(self, tensor, previous):
        payload = self._zstd.compress(tensor)
        meta = {
            "level": self._zstd.level,
            "shuffle": self._zstd.shuffle,
            "nbytes": tensor_nbytes(tensor),
        }
        return payload, meta

    def _check_meta(self, meta, dtype, shape, itemsize, payload_nbytes):
        check_zstd_meta(meta, self.name, numel_of(shape) * itemsize, payload_nbytes, None)

    def _decode(self, payload, meta, dtype, shape, previous, out):
        shuffled = meta_flag(meta, "shuffle", self.name)
        return self._zstd.decompress(payload, dtype, shape, shuffled=shuffled)


@register_codec
class XorDeltaZstdCodec(Codec):
    """XOR against the previous version, then byte shuffle + zstd; lossless."""

    name = "xor_delta_zstd"
    lossless = True
    needs_previous = True

    def __init__(self, level: int = 3, *, threads: int = 0) -> None:
        self._zstd = ShuffleZstd(level, threads=threads)

    def config(self) -> dict[str, Any]:
        return {"level": self._zstd.level, "threads": self._zstd.threads}

    def _encode(self, tensor, previous):
        assert previous is not None  # checked by encode()
        delta = encode_delta(tensor, previous.detach().to(tensor.device))
        payload = self._zstd.compress(delta, itemsize=tensor.element_size())
        meta = {
            "level": self._zstd.level,
            "shuffle": True,
            "nbytes": delta.numel(),
            "base": "previous",
        }
        return payload, meta

    def _check_meta(self, meta, dtype, shape, itemsize, payload_nbytes):
        check_zstd_meta(meta, self.name, numel_of(shape) * itemsize, payload_nbytes, True)
        meta_equal(meta, "base", self.name, "previous")

    def _decode(self, payload, meta, dtype, shape, previous, out):
        assert previous is not None  # checked by decode()
        if previous.dtype != dtype or tuple(previous.shape) != shape:
            raise ValueError(f"previous must be {dtype_name(dtype)}{shape} for {self.name!r}")
        width = torch.empty(0, dtype=dtype).element_size()
        delta = self._zstd.decompress(
            payload,
            torch.uint8,
            (numel_of(shape) * width,),
            shuffled=meta_flag(meta, "shuffle", self.name, True),
            itemsize=width,
        )
        prev = previous.detach()
        if out is not None and out.device == prev.device:
            return decode_delta(delta, prev, out=out)
        return decode_delta(delta, prev.cpu())
