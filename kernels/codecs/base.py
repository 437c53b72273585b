"""The codec contract and its registry: a codec's name is what a manifest records.

:class:`Codec` owns the argument checks of ``encode`` / ``decode`` / ``check_meta``; each
codec implements ``_encode``, ``_decode`` and ``_check_meta``. :func:`register_codec` adds a
codec class under its ``name`` (the shipped ones register when ``pcframe.kernels.codecs`` is
imported; a plugin registers its own), and :func:`get_codec` builds one by that name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from pcframe.kernels._tensor_bytes import BytesLike, byte_view
from pcframe.kernels.codecs.meta import decode_shape, element_size_of, payload_size, require
from pcframe.kernels.dtypes import dtype_name

FORMAT_VERSION = 1

_REGISTRY: dict[str, type[Codec]] = {}


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


def host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's logical bytes as a contiguous uint8 CPU tensor."""
    return byte_view(tensor.contiguous()).cpu()
