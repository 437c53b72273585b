"""The envelope of pcframe's JSON records: a one-line integrity header, then the body.

File form::

    {"format": "<name>", "format_version": N, "body_bytes": B, "body_crc32c": "..."}\\n
    <B bytes of JSON body>

Two records use it: a version's manifest (:mod:`pcframe.format.manifest`) and a multi-rank
checkpoint's global record (:mod:`pcframe.distributed.global_versions`). The header lets a
reader check the body's integrity before parsing it, so a flipped byte anywhere is detected
rather than silently changing a number. A ``format_version`` above what this code reads is
a newer writer, not damage: :class:`~pcframe.errors.UnsupportedCheckpoint`, which readers
stop at and never rename or skip past.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import crc32c

from pcframe.errors import CorruptCheckpoint, ManifestError, UnsupportedCheckpoint

CRC_DIGITS = 8  # body_crc32c: 8 lowercase hex digits


def seal(format_name: str, format_version: int, body: Any) -> bytes:
    """The file form of ``body`` (a JSON-able object) under its integrity header."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    header = {
        "format": format_name,
        "format_version": format_version,
        "body_bytes": len(raw),
        "body_crc32c": body_crc(raw),
    }
    return json.dumps(header).encode() + b"\n" + raw


def body_crc(raw: bytes) -> str:
    return f"{crc32c.crc32c(raw):08x}"


def is_crc(value: Any) -> bool:
    """Whether ``value`` is a ``body_crc32c`` as :func:`seal` writes it."""
    return (
        isinstance(value, str)
        and len(value) == CRC_DIGITS
        and all(c in "0123456789abcdef" for c in value)
    )


@dataclass(frozen=True)
class Envelope:
    """One kind of record: its format name, the versions this code reads, how messages name
    it (``what``), and the fix a message about a damaged one ends with (``fix``)."""

    format_name: str
    readable: tuple[int, ...]
    what: str
    fix: str = ""

    def open(self, raw: bytes, path: object) -> tuple[int, Any]:
        """Check the header and the body's integrity, then parse the body.

        Returns ``(format_version, body)``.

        Raises:
            CorruptCheckpoint: the header is missing or garbled, or the body's size or
                checksum is not the header's.
            UnsupportedCheckpoint: a newer format version (a newer writer).
            ManifestError: another format, an unknown version, a body that is not JSON.
        """
        what, fix = self.what, f"; {self.fix}" if self.fix else ""
        line, sep, body = raw.partition(b"\n")
        if not sep:
            raise CorruptCheckpoint(f"{path}: {what} has no header line (truncated?){fix}")
        try:
            header = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise CorruptCheckpoint(f"{path}: {what} header is not JSON ({exc}){fix}") from None
        if not isinstance(header, dict) or header.get("format") != self.format_name:
            raise ManifestError(f"{path}: not a pcframe {what} (header {line[:80]!r}){fix}")
        written = header.get("format_version")
        if type(written) is not int or written not in self.readable:
            newer = type(written) is int and written > max(self.readable)
            raise (UnsupportedCheckpoint if newer else ManifestError)(
                f"{path}: {what} format_version {written!r} is not supported by this "
                f"pcframe (reads versions {', '.join(map(str, self.readable))}); upgrade "
                "pcframe to read it"
            )
        if header.get("body_bytes") != len(body):
            raise CorruptCheckpoint(
                f"{path}: {what} body is {len(body)} bytes, header says "
                f"{header.get('body_bytes')!r}{fix}"
            )
        if header.get("body_crc32c") != body_crc(body):
            raise CorruptCheckpoint(f"{path}: {what} checksum mismatch (bytes were altered){fix}")
        try:
            return written, json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise ManifestError(f"{path}: {what} body is not valid JSON ({exc}){fix}") from None


@dataclass(frozen=True)
class BodyFields:
    """Checks of a parsed body's fields; every error names the file (``where``) first."""

    where: str

    def fail(self, reason: str, kind: type[ManifestError] = ManifestError) -> ManifestError:
        return kind(f"{self.where}: {reason}")

    def integer(self, value: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
        """``value`` if it is an int (not a bool) in ``[lo, hi]``."""
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.fail(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
        return value


def header_crc(line: bytes, path: object) -> str:
    """The ``body_crc32c`` of a record's header line (what a global record pins a shard's
    manifest by).

    Raises:
        CorruptCheckpoint: the line is not a header with a valid checksum.
    """
    try:
        crc = json.loads(line)["body_crc32c"]
    except (ValueError, KeyError, TypeError):
        raise CorruptCheckpoint(f"{path}: manifest header is unreadable") from None
    if not is_crc(crc):
        raise CorruptCheckpoint(f"{path}: manifest header has no valid body_crc32c")
    return crc
