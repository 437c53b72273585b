"""Named tensor codecs: what the engine records per tensor in its JSON manifest.

``encode(tensor) -> (payload, meta)`` and ``decode(payload, meta, dtype, shape)``; the
payload is a bytes-like ``memoryview`` and ``meta`` holds only JSON types (no pickle
anywhere), and everything decoding needs is in ``meta``, so any instance of a codec
decodes what any other instance encoded. The default, ``"raw"``, is bit-exact.

=================  ========  ===============================================
name               lossless  payload
=================  ========  ===============================================
``raw``            yes       the logical bytes
``zstd``           yes       byte shuffle + zstd
``int8_block``     no        int8 codes, then fp32 per-block scales
``fp8_block``      no        e4m3fn codes, then fp32 per-block scales
``xor_delta_zstd`` yes       zstd(shuffle(bytes XOR previous version's bytes))
=================  ========  ===============================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from pcframe.kernels._codec_meta import (
    check_block_meta,
    check_block_values,
    check_zstd_meta,
    decode_shape,
    element_size_of,
    meta_equal,
    meta_flag,
    payload_size,
    require,
)
from pcframe.kernels._tensor_bytes import (
    BytesLike,
    as_uint8_array,
    as_uint8_tensor,
    byte_view,
    tensor_nbytes,
)
from pcframe.kernels.delta import decode_delta, encode_delta
from pcframe.kernels.dtypes import dtype_name
from pcframe.kernels.lossless import ShuffleZstd
from pcframe.kernels.quantize import (
    DEFAULT_BLOCK_SIZE,
    QuantizedTensor,
    dequantize_blockwise,
    error_bounds,
    quantize_blockwise,
)

FORMAT_VERSION = 1

__all__ = [
    "FORMAT_VERSION",
    "Codec",
    "Fp8BlockCodec",
    "Int8BlockCodec",
    "RawCodec",
    "XorDeltaZstdCodec",
    "ZstdCodec",
    "available_codecs",
    "dtype_name",
    "get_codec",
    "register_codec",
]

_REGISTRY: dict[str, type[Codec]] = {}


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class Codec(ABC):
    """A named, reversible (or bounded-error) tensor encoding.

    Subclasses set ``name`` and ``lossless`` and implement ``_encode`` / ``_decode``;
    the public methods own the argument checks.
    """

    name: ClassVar[str]
    lossless: ClassVar[bool]
    needs_previous: ClassVar[bool] = False

    def config(self) -> dict[str, Any]:
        """Constructor arguments (JSON types), e.g. for a Hydra config or a log line."""
        return {}

    def encode(
        self, tensor: torch.Tensor, *, previous: torch.Tensor | None = None
    ) -> tuple[memoryview, dict[str, Any]]:
        """Encode ``tensor`` (any device; payload is host memory).

        Args:
            tensor: The tensor to encode.
            previous: The previous version of the same tensor (only for codecs with
                ``needs_previous``).

        Returns:
            ``(payload, meta)``: payload bytes and the JSON-able meta decoding needs.
        """
        if self.needs_previous and previous is None:
            raise ValueError(f"codec {self.name!r} needs previous= (the previous version)")
        payload, meta = self._encode(tensor.detach(), previous)
        return memoryview(payload).cast("B"), {"format_version": FORMAT_VERSION, **meta}

    def decode(
        self,
        payload: BytesLike,
        meta: Mapping[str, Any],
        dtype: torch.dtype,
        shape: Sequence[int],
        *,
        previous: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode a payload into a tensor of ``dtype`` and ``shape``.

        Args:
            payload: What :meth:`encode` returned (or the same bytes read back).
            meta: The meta :meth:`encode` returned (e.g. parsed back from JSON).
            dtype: The tensor's dtype (from the manifest).
            shape: The tensor's shape (from the manifest).
            previous: Previous version, for codecs with ``needs_previous``.
            out: Optional tensor of ``dtype`` and ``shape`` to decode into (any
                device); it is returned.

        Raises:
            ValueError: Meta from another format version, missing keys, or a payload
                that does not match ``dtype`` and ``shape``.
        """
        shape = decode_shape(shape, self.name)
        self.check_meta(meta, dtype, shape, payload_size(payload))
        if self.needs_previous and previous is None:
            raise ValueError(f"codec {self.name!r} needs previous= (the previous version)")
        if out is not None and (out.dtype != dtype or tuple(out.shape) != shape):
            raise ValueError(
                f"out must be {dtype_name(dtype)}{shape}, got {out.dtype}{tuple(out.shape)}"
            )
        result = self._decode(payload, meta, dtype, shape, previous, out)
        if result.dtype != dtype or tuple(result.shape) != shape:  # never trust a decoder
            raise ValueError(
                f"codec {self.name!r}: decoded {result.dtype}{tuple(result.shape)}, expected "
                f"{dtype_name(dtype)}{shape}"
            )
        if out is None:
            return result
        if result is not out:
            out.copy_(result)
        return out

    def check_meta(
        self,
        meta: Mapping[str, Any],
        dtype: torch.dtype,
        shape: Sequence[int],
        payload_nbytes: int,
    ) -> None:
        """Check that ``meta`` and a payload of ``payload_nbytes`` can decode to ``dtype`` x
        ``shape``: every key the decoder reads has the right type and range, and every size
        it records agrees with the tensor. :meth:`decode` calls it first; a manifest reader
        calls it before reading any payload.

        Raises:
            ValueError: naming the codec, the meta key and what is wrong with it.
        """
        if not isinstance(meta, Mapping):
            raise ValueError(f"codec {self.name!r}: meta must be an object, got {meta!r:.40}")
        version = require(meta, "format_version", self.name)
        if type(version) is not int or version != FORMAT_VERSION:
            raise ValueError(
                f"codec {self.name!r}: format_version {version!r:.40} is not {FORMAT_VERSION}"
            )
        shape = decode_shape(shape, self.name)
        if isinstance(payload_nbytes, bool) or not isinstance(payload_nbytes, int):
            raise ValueError(f"codec {self.name!r}: payload size {payload_nbytes!r:.40}")
        self._check_meta(meta, dtype, shape, element_size_of(dtype, self.name), payload_nbytes)

    def _check_meta(
        self,
        meta: Mapping[str, Any],
        dtype: torch.dtype,
        shape: tuple[int, ...],
        itemsize: int,
        payload_nbytes: int,
    ) -> None:
        """Codec-specific meta checks (subclasses extend; the base checks nothing more)."""
        del meta, dtype, shape, itemsize, payload_nbytes

    @abstractmethod
    def _encode(
        self, tensor: torch.Tensor, previous: torch.Tensor | None
    ) -> tuple[BytesLike, dict[str, Any]]: ...

    @abstractmethod
    def _decode(
        self,
        payload: BytesLike,
        meta: Mapping[str, Any],
        dtype: torch.dtype,
        shape: tuple[int, ...],
        previous: torch.Tensor | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor: ...


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator adding a codec to the registry; a duplicate name raises."""
    if cls.name in _REGISTRY:
        raise ValueError(f"codec name {cls.name!r} is already registered by {_REGISTRY[cls.name]}")
    _REGISTRY[cls.name] = cls
    return cls


def get_codec(name: str, **config: Any) -> Codec:
    """Instantiate a registered codec by name with its constructor arguments."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown codec {name!r}; registered: {available_codecs()}")
    return _REGISTRY[name](**config)


def available_codecs() -> tuple[str, ...]:
    """Registered codec names."""
    return tuple(_REGISTRY)


def _host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return byte_view(tensor.contiguous()).cpu()


@register_codec
class RawCodec(Codec):
    """The logical bytes as they are (bit-exact; zero-copy for contiguous CPU tensors)."""

    name = "raw"
    lossless = True

    def _encode(self, tensor, previous):
        return _host_bytes(tensor).numpy(), {"nbytes": tensor_nbytes(tensor)}

    def _check_meta(self, meta, dtype, shape, itemsize, payload_nbytes):
        expected = _numel(shape) * itemsize
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
        check_zstd_meta(meta, self.name, _numel(shape) * itemsize, payload_nbytes, None)

    def _decode(self, payload, meta, dtype, shape, previous, out):
        shuffled = meta_flag(meta, "shuffle", self.name)
        return self._zstd.decompress(payload, dtype, shape, shuffled=shuffled)


class _BlockQuantCodec(Codec):
    """Shared body of the block-quantized codecs: payload = codes, pad to 4, fp32 scales."""

    lossless = False
    fmt: ClassVar[str]

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = block_size

    def config(self) -> dict[str, Any]:
        return {"block_size": self.block_size}

    def _encode(self, tensor, previous):
        q = quantize_blockwise(tensor, self.fmt, self.block_size)
        codes = _host_bytes(q.codes)
        scales_offset = -(-codes.numel() // 4) * 4
        payload = torch.zeros(scales_offset + 4 * q.scales.numel(), dtype=torch.uint8)
        payload[: codes.numel()] = codes
        payload[scales_offset:] = byte_view(q.scales.cpu())
        meta = {
            "fmt": self.fmt,
            "block_size": self.block_size,
            "n_blocks": q.scales.numel(),
            "codes_nbytes": codes.numel(),
            "scales_offset": scales_offset,
            "scales_dtype": "float32",
            "error_bound": q.max_error,
            "source_dtype": dtype_name(tensor.dtype),
        }
        return payload.numpy(), meta

    def _check_meta(self, meta, dtype, shape, itemsize, payload_nbytes):
        check_block_meta(meta, self.name, self.fmt, dtype, shape, payload_nbytes)

    def _decode(self, payload, meta, dtype, shape, previous, out):
        get = lambda key: require(meta, key, self.name)  # noqa: E731
        data = as_uint8_tensor(payload)
        n, n_blocks, offset = get("codes_nbytes"), get("n_blocks"), get("scales_offset")
        device = out.device if out is not None else torch.device("cpu")
        scales = torch.empty(n_blocks, dtype=torch.float32)
        byte_view(scales).copy_(data[offset:])
        overflow_possible = check_block_values(self.name, self.fmt, data[:n], scales, dtype)
        codes = data[:n].to(device)
        scales = scales.to(device)
        q = QuantizedTensor(
            codes=codes if self.fmt != "int8" else codes.view(torch.int8),
            scales=scales,
            error_bound=error_bounds(scales, self.fmt, dtype),
            fmt=self.fmt,
            block_size=int(get("block_size")),
            shape=shape,
            dtype=dtype,
        )
        result = dequantize_blockwise(q, out=out)
        if overflow_possible and not bool(torch.isfinite(result).all()):
            raise ValueError(
                f"codec {self.name!r}: scales near the {dtype_name(dtype)} limit decode to "
                "infinities (the encoder never writes such a payload)"
            )
        return result


@register_codec
class Int8BlockCodec(_BlockQuantCodec):
    """int8 codes with per-block absmax scales (lossy, bound recorded in meta)."""

    name = "int8_block"
    fmt = "int8"


@register_codec
class Fp8BlockCodec(_BlockQuantCodec):
    """fp8 e4m3fn codes with per-block absmax scales (lossy, bound recorded in meta)."""

    name = "fp8_block"
    fmt = "fp8_e4m3"


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
        check_zstd_meta(meta, self.name, _numel(shape) * itemsize, payload_nbytes, True)
        meta_equal(meta, "base", self.name, "previous")

    def _decode(self, payload, meta, dtype, shape, previous, out):
        assert previous is not None  # checked by decode()
        if previous.dtype != dtype or tuple(previous.shape) != shape:
            raise ValueError(f"previous must be {dtype_name(dtype)}{shape} for {self.name!r}")
        width = torch.empty(0, dtype=dtype).element_size()
        delta = self._zstd.decompress(
            payload,
            torch.uint8,
            (_numel(shape) * width,),
            shuffled=meta_flag(meta, "shuffle", self.name, True),
            itemsize=width,
        )
        prev = previous.detach()
        if out is not None and out.device == prev.device:
            return decode_delta(delta, prev, out=out)
        return decode_delta(delta, prev.cpu())
