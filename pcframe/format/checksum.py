"""Per-chunk checksums as the manifest records them: hex digests, or none at all.

The algorithms are the kernels' (:mod:`pcframe.kernels.checksum` owns the list and computes
them); this module adds what only the engine knows: ``"none"`` (no checksum) and the hex form
written to the manifest. A chunk may arrive in several buffers, so digests are computed
incrementally over a sequence of buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pcframe.kernels.checksum import ALGORITHMS, DIGEST_BITS, checksum_buffers

NONE = "none"
# What ``EngineConfig.checksum`` and a manifest's ``checksum`` may name.
CHECKSUMS: tuple[str, ...] = (*ALGORITHMS, NONE)


def _none(buffers: Iterable[memoryview]) -> str:
    del buffers
    return ""


def checksum_function(name: str) -> Callable[[Iterable[memoryview]], str]:
    """Return ``f(buffers) -> hex digest`` of the concatenation of ``buffers``."""
    if name == NONE:
        return _none
    if name not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {name!r}; known: {', '.join(CHECKSUMS)}")

    def digest(buffers: Iterable[memoryview]) -> str:
        return format_digest(name, checksum_buffers(buffers, name))

    return digest


def format_digest(name: str, value: int | None) -> str:
    """The manifest's hex form of a checksum a kernel returned as an int (``""`` for none)."""
    if name == NONE or value is None:
        return ""
    return f"{value:0{DIGEST_BITS[name] // 4}x}"
