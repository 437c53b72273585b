"""The segments of format 2's coded tensors: each tensor covered in order, codec.bin tiled.

A coded tensor's ``segments`` are ``[offset, length, checksum, start, count, meta]``: bytes
``[offset, offset + length)`` of ``codec.bin`` decode, by the tensor's codec and ``meta``, to
its elements ``[start, start + count)``. :class:`CodedSegments` checks each tensor's list as
:func:`pcframe.format.manifest.parse_body` meets it, then that all of them together tile
``codec.bin`` exactly (no overlap, no byte left unverified).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pcframe.errors import UnsupportedCheckpoint
from pcframe.format.names import CODEC_NAME
from pcframe.kernels.dtypes import DTYPES


@dataclass(frozen=True)
class SegmentRecord:
    """One encoded segment of a coded tensor: where its payload is and what it holds."""

    offset: int  # byte offset of the payload in codec.bin
    length: int  # payload bytes
    checksum: str  # of the payload, with the manifest's algorithm
    start: int  # first element of the tensor (row-major) it holds
    count: int  # elements it holds
    meta: dict[str, Any]  # the codec's JSON meta (scales offset, error bound, ...)

    def to_list(self) -> list[Any]:
        return [self.offset, self.length, self.checksum, self.start, self.count, self.meta]


class CodedSegments:
    """Validates coded tensors' segments: each tensor covered in order, codec.bin tiled."""

    def __init__(
        self, fail: Any, integer: Any, chunk_bytes: int, codec_size: int, format_version: int
    ) -> None:
        self.fail, self.integer = fail, integer
        self.chunk_bytes, self.codec_size = chunk_bytes, codec_size
        self.format_version = format_version
        self.segments: dict[int, list[SegmentRecord]] = {}
        self.needs_base = False

    def check_codec(self, name: str, codec: Any) -> None:
        from pcframe.kernels.codecs import available_codecs, get_codec

        if self.format_version < 2:
            raise self.fail(
                f"tensor {name!r} uses codec {codec!r}, unknown to format version 1 (raw only)"
            )
        if codec not in available_codecs():
            # A name this process lacks may be a newer pcframe's or a plugin's not imported
            # here: unsupported, not corrupt (the caller refused anything but a name).
            raise self.fail(
                f"tensor {name!r} uses unknown codec {codec!r:.60}; this pcframe knows "
                f"{', '.join(available_codecs())} (a newer pcframe or a plugin may add more: "
                "upgrade pcframe or import the plugin that registers it)",
                UnsupportedCheckpoint,
            )
        self.needs_base = self.needs_base or get_codec(codec).needs_previous

    def parse(self, index: int, name: str, codec: str, numel: int, dtype: str, raw: Any) -> None:
        from pcframe.kernels.codecs import get_codec

        fail, integer = self.fail, self.integer
        itemsize, decoder = DTYPES[dtype].itemsize, get_codec(codec)
        if not isinstance(raw, list) or (numel and not raw) or len(raw) > numel:
            raise fail(f"tensor {name!r}: 'segments' must be a list of 1..{numel} segments")
        records, cursor = [], 0
        for k, item in enumerate(raw):
            where = f"tensor {name!r} segment {k}"
            if not isinstance(item, list) or len(item) != 6 or not isinstance(item[2], str):
                raise fail(f"{where} must be [offset, length, checksum, start, count, meta]")
            offset = integer(item[0], f"{where} offset", 0, self.codec_size)
            length = integer(item[1], f"{where} length", 1, self.codec_size)
            if offset + length > self.codec_size:
                raise fail(f"{where} ends past the {self.codec_size} bytes of {CODEC_NAME}")
            start = integer(item[3], f"{where} start", 0, numel)
            # One segment never holds more than one staging chunk of raw bytes: this bounds
            # what a hostile manifest can make a decoder allocate per segment.
            count = integer(item[4], f"{where} count", 1, max(1, self.chunk_bytes // itemsize))
            if start != cursor:
                raise fail(f"{where} starts at element {start}, expected {cursor}")
            if not isinstance(item[5], dict):
                raise fail(f"{where} meta must be an object")
            try:  # the codec's own schema: sizes, ranges, flags, agreeing with the tensor
                decoder.check_meta(item[5], DTYPES[dtype], (count,), length)
            except ValueError as exc:
                raise fail(f"{where} meta: {exc}") from None
            cursor += count
            records.append(SegmentRecord(offset, length, item[2], start, count, item[5]))
        if cursor != numel:
            raise fail(f"tensor {name!r}: segments cover {cursor} of {numel} elements")
        self.segments[index] = records

    def check_tiling(self) -> None:
        """Payloads must tile codec.bin exactly: no overlap, no unverified bytes."""
        spans = sorted((s.offset, s.length) for r in self.segments.values() for s in r)
        cursor = 0
        for offset, length in spans:
            if offset != cursor:
                what = "overlaps another" if offset < cursor else f"leaves a gap at byte {cursor}"
                raise self.fail(f"a segment at byte {offset} of {CODEC_NAME} {what}")
            cursor += length
        if cursor != self.codec_size:
            raise self.fail(f"segments cover {cursor} bytes of {CODEC_NAME}, not {self.codec_size}")
