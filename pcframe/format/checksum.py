"""Per-chunk checksums, computed incrementally so a chunk may arrive in several buffers."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import crc32c
import xxhash

from pcframe.config import CHECKSUMS


def _crc32c(buffers: Iterable[memoryview]) -> str:
    value = 0
    for buffer in buffers:
        value = crc32c.crc32c(buffer, value)  # releases the GIL on large buffers
    return f"{value:08x}"


def _xxh3_64(buffers: Iterable[memoryview]) -> str:
    state = xxhash.xxh3_64()
    for buffer in buffers:
        state.update(buffer)
    return state.hexdigest()


def _pcf64(buffers: Iterable[memoryview]) -> str:
    from pcframe.kernels.checksum import pcf64_buffers

    return f"{pcf64_buffers(buffers):016x}"


def _none(buffers: Iterable[memoryview]) -> str:
    del buffers
    return ""


_ALGORITHMS: dict[str, Callable[[Iterable[memoryview]], str]] = {
    "crc32c": _crc32c,
    "xxh3_64": _xxh3_64,
    "pcf64": _pcf64,
    "none": _none,
}
_DIGITS = {"crc32c": 8, "xxh3_64": 16, "pcf64": 16}
assert set(_ALGORITHMS) == set(CHECKSUMS)


def checksum_function(name: str) -> Callable[[Iterable[memoryview]], str]:
    """Return ``f(buffers) -> hex digest`` of the concatenation of ``buffers``."""
    try:
        return _ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown checksum algorithm {name!r}; known: {', '.join(_ALGORITHMS)}"
        ) from None


def format_digest(name: str, value: int | None) -> str:
    """The manifest's hex form of a checksum a kernel returned as an int (``""`` for none)."""
    if name == "none" or value is None:
        return ""
    return f"{value:0{_DIGITS[name]}x}"
