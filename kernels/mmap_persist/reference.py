"""Persist a staged chunk into a mapped file region, in plain numpy: the specification.

``region[offset : offset + len(chunk)] = chunk``, and the chunk's checksum (of the bytes
as written) is returned. Durability comes from :func:`pcframe.kernels.flush_mmap`.
"""

from __future__ import annotations

import numpy as np

from pcframe.kernels.checksum import checksum


def persist(region: np.ndarray, offset: int, chunk: np.ndarray, algo: str) -> int:
    """Copy ``chunk`` into ``region`` at ``offset``; return its ``algo`` checksum."""
    dst = region[offset : offset + chunk.size]
    dst[:] = chunk
    return checksum(dst, algo, backend="torch")  # the reference implementations
