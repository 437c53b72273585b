"""The codec stage: which tensors are encoded, how they are cut, and how one piece is encoded.

``EngineConfig.codecs`` maps tensor-name globs to codecs. A matched tensor does not go into
``data.bin``: it is cut into *segments* of whole elements (at most one staging chunk of raw
bytes each, aligned to the codec's quantization blocks so a segment encodes exactly like the
same range of the whole tensor would). The copy stage copies a segment's raw bytes into a
staging buffer (that is all the optimizer step waits for), then a writer thread encodes it,
checksums the payload and appends it to ``codec.bin``. Encoded sizes are only known then,
so ``codec.bin`` is packed in completion order and the manifest lists every segment's
``[offset, length, checksum, first element, element count, codec meta]``.

``xor_delta_zstd`` tensors are stored as the XOR against the previous committed version
(a *delta version*), or with ``zstd`` in a *full version*; see :mod:`pcframe.save.delta`.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from pcframe.errors import ConfigError
from pcframe.format.layout import Entry, Layout
from pcframe.format.tree import DTYPES
from pcframe.kernels.codecs import Codec, available_codecs, get_codec
from pcframe.kernels.quantize import DEFAULT_BLOCK_SIZE

log = logging.getLogger("pcframe")

DELTA_CODEC = "xor_delta_zstd"
FULL_CODEC = "zstd"  # what delta tensors are stored with in a full version
_LOSSY_DTYPES = ("float32", "bfloat16", "float16")
_MAX_ITEMSIZE = 16


@dataclass(frozen=True)
class CodecSpec:
    """A codec name and its constructor options, as configured."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @cached_property
    def codec(self) -> Codec:
        return get_codec(self.name, **dict(self.options))

    @property
    def block_elements(self) -> int:
        """Segment starts must be multiples of this many elements."""
        if self.lossless:
            return 1
        return int(dict(self.options).get("block_size", DEFAULT_BLOCK_SIZE))

    @property
    def lossless(self) -> bool:
        return self.codec.lossless

    @property
    def is_delta(self) -> bool:
        return self.name == DELTA_CODEC

    def full_spec(self) -> CodecSpec:
        """What a delta tensor is stored with in a full version: zstd at the same level."""
        level = dict(self.options).get("level")
        return CodecSpec(FULL_CODEC, (("level", level),) if level is not None else ())


def parse_codec_config(codecs: Mapping[str, Any]) -> list[tuple[str, CodecSpec]]:
    """``EngineConfig.codecs`` as an ordered list of ``(glob, CodecSpec)``.

    Raises:
        ValueError: naming the pattern and what is wrong with it.
    """
    if not isinstance(codecs, Mapping):
        raise ValueError("must map tensor-name globs to codec names, e.g. {'model/*': 'zstd'}")
    rules = []
    for pattern, value in codecs.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"pattern {pattern!r} must be a non-empty tensor-name glob")
        if isinstance(value, str):
            name, options = value, {}
        elif isinstance(value, Mapping) and isinstance(value.get("codec"), str):
            options = {str(k): v for k, v in value.items() if k != "codec"}
            name = value["codec"]
        else:
            raise ValueError(
                f"{pattern!r}: give a codec name or {{codec: name, ...options}}, got {value!r}"
            )
        if name not in available_codecs():
            raise ValueError(f"{pattern!r}: unknown codec {name!r}; known: {available_codecs()}")
        spec = CodecSpec(name, tuple(sorted(options.items())))
        try:
            spec.codec  # noqa: B018 - builds the codec: bad options fail here, not at save
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"{pattern!r}: codec {name!r} rejects options {options}: {exc}"
            ) from None
        rules.append((pattern, spec))
    return rules


def check_codec_config(codecs: Mapping[str, Any], chunk_bytes: int) -> None:
    """Validate ``EngineConfig.codecs`` against the chunk size (raises ``ValueError``)."""
    for pattern, spec in parse_codec_config(codecs):
        if spec.block_elements * _MAX_ITEMSIZE > chunk_bytes:
            raise ValueError(
                f"{pattern!r}: block_size {spec.block_elements} does not fit a {chunk_bytes}-byte "
                f"chunk; use block_size <= {chunk_bytes // _MAX_ITEMSIZE} or larger chunk_bytes"
            )


def _warn_unused_rules(patterns: list[str], names: list[str]) -> None:
    """A rule that codes no tensor is a typo or a misordering, and it fails silently: the
    tensors it meant stay raw, or get an earlier rule's codec (first match wins)."""
    first = {n: next((p for p in patterns if fnmatch.fnmatchcase(n, p)), None) for n in names}
    for pattern in patterns:
        named = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not named:
            log.warning(
                "engine.codecs[%r] matches no tensor of this state (its names look like %r)",
                pattern, names[0] if names else "",
            )  # fmt: skip
        elif all(first[n] != pattern for n in named):
            earlier = sorted({first[n] for n in named if first[n] is not None})
            log.warning(
                "engine.codecs[%r] codes no tensor: every tensor it matches matched %s first "
                "(first match wins: put the narrower pattern first)",
                pattern, ", ".join(repr(e) for e in earlier),
            )  # fmt: skip


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, start + count)`` of one coded tensor: one staging buffer's worth."""

    entry: int
    start: int
    count: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


@dataclass(frozen=True)
class CodecPlan:
    """How one state layout is stored: raw tensors in ``data.bin``, coded ones in segments.

    Built once per layout (the checkpointer reuses a layout while the state's signature is
    unchanged), so the per-save hot path does no matching.
    """

    layout: Layout  # entries in the original order; coded ones are outside data.bin
    specs: Mapping[int, CodecSpec]
    segments: tuple[Segment, ...]

    @classmethod
    def build(cls, layout: Layout, codecs: Mapping[str, Any], align: int) -> CodecPlan:
        """Match entry names against the configured globs and cut coded tensors.

        Raises:
            ConfigError: a lossy codec matched a tensor it cannot encode.
        """
        rules = parse_codec_config(codecs) if codecs else []
        _warn_unused_rules([p for p, _ in rules], [e.name for e in layout.entries])
        specs: dict[int, CodecSpec] = {}
        for index, entry in enumerate(layout.entries):
            if entry.nbytes == 0:
                continue  # nothing to encode: stays a zero-length raw entry
            for pattern, spec in rules:
                if fnmatch.fnmatchcase(entry.name, pattern):
                    if not spec.lossless and entry.dtype not in _LOSSY_DTYPES:
                        raise ConfigError(
                            f"engine.codecs[{pattern!r}]: lossy codec {spec.name!r} matched "
                            f"tensor {entry.name!r} of dtype {entry.dtype}; it encodes "
                            f"{', '.join(_LOSSY_DTYPES)} only. Narrow the pattern"
                        )
                    if spec.name != "raw":  # "raw" keeps the tensor in data.bin
                        specs[index] = spec
                    break
        if not specs:
            return cls(layout, {}, ())
        entries, offset = [], 0
        for index, entry in enumerate(layout.entries):
            if index in specs:
                entries.append(replace(entry, offset=0, codec=specs[index].name))
            else:
                offset = -(-offset // align) * align
                entries.append(replace(entry, offset=offset))
                offset += entry.nbytes
        raw = Layout.from_entries(entries, offset, layout.chunk_bytes)
        segments = []
        for index, spec in specs.items():
            entry = layout.entries[index]
            itemsize = DTYPES[entry.dtype].itemsize
            numel = math.prod(entry.shape)
            block = spec.block_elements
            per = max(block, layout.chunk_bytes // itemsize // block * block)
            segments.extend(
                Segment(index, start, min(per, numel - start), itemsize)
                for start in range(0, numel, per)
            )
        return cls(raw, specs, tuple(segments))

    @property
    def delta_entries(self) -> frozenset[int]:
        return frozenset(i for i, s in self.specs.items() if s.is_delta)

    def delta_key(self) -> tuple:
        """Identity of the delta tensors: a reference is only reused for the same ones."""
        entries = self.layout.entries
        return tuple(
            (i, entries[i].name, entries[i].dtype, entries[i].shape)
            for i in sorted(self.delta_entries)
        )

    def spec_for(self, entry: int, delta: bool) -> CodecSpec:
        """The codec an entry is stored with in a delta (``delta``) or a full version."""
        spec = self.specs[entry]
        return spec if delta or not spec.is_delta else spec.full_spec()

    def stored_entries(self, delta: bool) -> list[Entry]:
        """Manifest entries: each coded one names the codec it was stored with."""
        return [
            replace(e, codec=self.spec_for(i, delta).name) if i in self.specs else e
            for i, e in enumerate(self.layout.entries)
        ]


def encode_segment(
    spec: CodecSpec, staged: torch.Tensor, dtype: torch.dtype, previous: torch.Tensor | None
) -> tuple[memoryview, dict[str, Any]]:
    """Encode one staged segment (raw bytes in a staging buffer) with ``spec``.

    ``previous`` is the same element range of the base version (delta codecs only).
    """
    values = staged.view(dtype)
    return spec.codec.encode(values, previous=previous if spec.is_delta else None)
