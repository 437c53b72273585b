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


def _require(meta: Mapping[str, Any], key: str, codec: str) -> Any:
    if key not in meta:
        raise ValueError(f"codec {codec!r}: meta lacks key {key!r}")
    return meta[key]


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
        version = _require(meta, "format_version", self.name)
        if version != FORMAT_VERSION:
            raise ValueError(
                f"codec {self.name!r}: format_version {version} is not {FORMAT_VERSION}"
            )
        if self.needs_previous and previous is None:
            raise ValueError(f"codec {self.name!r} needs previous= (the previous version)")
        shape = tuple(int(s) for s in shape)
        if out is not None and (out.dtype != dtype or tuple(out.shape) != shape):
            raise ValueError(
                f"out must be {dtype_name(dtype)}{shape}, got {out.dtype}{tuple(out.shape)}"
            )
        result = self._decode(payload, meta, dtype, shape, previous, out)
        if out is None:
            return result
        if result is not out:
            out.copy_(result)
        return out

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

    def _decode(self, payload, meta, dtype, shape, previous, out):
        data = as_uint8_array(payload)
        expected = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
        if data.size != expected or _require(meta, "nbytes", self.name) != expected:
            raise ValueError(
                f"raw payload has {data.size} bytes, {dtype_name(dtype)}{shape} needs {expected}"
            )
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

    def _decode(self, payload, meta, dtype, shape, previous, out):
        shuffled = bool(_require(meta, "shuffle", self.name))
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

    def _decode(self, payload, meta, dtype, shape, previous, out):
        get = lambda key: _require(meta, key, self.name)  # noqa: E731
        if get("fmt") != self.fmt:
            raise ValueError(f"codec {self.name!r}: meta fmt {get('fmt')!r} is not {self.fmt!r}")
        data = as_uint8_tensor(payload)
        n, n_blocks, offset = get("codes_nbytes"), get("n_blocks"), get("scales_offset")
        if n != _numel(shape) or data.numel() != offset + 4 * n_blocks:
            raise ValueError(
                f"codec {self.name!r}: payload does not match {dtype_name(dtype)}{shape}"
            )
        device = out.device if out is not None else torch.device("cpu")
        codes = data[:n].to(device)
        scales = torch.empty(n_blocks, dtype=torch.float32)
        byte_view(scales).copy_(data[offset:])
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
        return dequantize_blockwise(q, out=out)


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

    def _decode(self, payload, meta, dtype, shape, previous, out):
        assert previous is not None  # checked by decode()
        if previous.dtype != dtype or tuple(previous.shape) != shape:
            raise ValueError(f"previous must be {dtype_name(dtype)}{shape} for {self.name!r}")
        width = torch.empty(0, dtype=dtype).element_size()
        delta = self._zstd.decompress(
            payload,
            torch.uint8,
            (_numel(shape) * width,),
            shuffled=bool(meta.get("shuffle", True)),
            itemsize=width,
        )
        prev = previous.detach()
        if out is not None and out.device == prev.device:
            return decode_delta(delta, prev, out=out)
        return decode_delta(delta, prev.cpu())
