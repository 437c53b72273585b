"""Per-chunk checksums, named stably because the manifest records the name.

* ``"crc32c"``: CRC-32C (Castagnoli), via the hardware-accelerated ``crc32c`` package.
* ``"xxh3_64"``: XXH3 64-bit, seed 0, via ``xxhash``.
* ``"pcf64"``: pcframe's block-parallel 64-bit checksum (specified in
  ``checksum/reference.py``); Numba and Triton fuse it into the copy
  (:func:`pcframe.kernels.gather_checksum`, :func:`pcframe.kernels.persist_chunk_mmap`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from pcframe.kernels._tensor_bytes import BytesLike, as_uint8_array, as_uint8_tensor, byte_view
from pcframe.kernels.checksum import reference
from pcframe.kernels.dispatch import backend_module, resolve_backend

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "DIGEST_BITS",
    "check_algorithm",
    "checksum",
    "checksum_buffers",
    "pcf64_buffers",
]

DEFAULT_ALGORITHM = "pcf64"


def check_algorithm(algo: str) -> None:
    """Raise ``ValueError`` for an unknown algorithm name."""
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algo!r}; choose one of {ALGORITHMS}")


def checksum(data: BytesLike, algo: str = DEFAULT_ALGORITHM, *, backend: str = "auto") -> int:
    """Checksum of the bytes of ``data``.

    Args:
        data: bytes-like object, numpy array or tensor (its logical bytes; a CUDA tensor
            is hashed on the GPU for ``"pcf64"`` and copied to host for the others).
        algo: ``"pcf64"``, ``"crc32c"`` or ``"xxh3_64"``.
        backend: For ``"pcf64"``: ``"auto"``, ``"torch"``, ``"numba"`` or ``"triton"``.
            The other algorithms have one (library) implementation: ``"auto"`` or
            ``"torch"`` only.

    Returns:
        The checksum as a non-negative int (< 2**32 for crc32c, < 2**64 otherwise).
    """
    check_algorithm(algo)
    if isinstance(data, torch.Tensor):
        data = byte_view(data.detach().contiguous())
    if algo != "pcf64":
        if backend not in ("auto", "torch"):
            raise ValueError(
                f"checksum {algo!r} is computed by its library; backend must be 'auto' "
                f"or 'torch', got {backend!r}"
            )
        host = data.cpu() if isinstance(data, torch.Tensor) else data
        return checksum_buffers([memoryview(as_uint8_array(host))], algo)
    device = data.device if isinstance(data, torch.Tensor) else torch.device("cpu")
    name = resolve_backend(backend, device, op="checksum")
    impl = backend_module("checksum", name)
    if name == "triton":
        return impl.pcf64(as_uint8_tensor(data))
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        data = data.cpu()
    return impl.pcf64(as_uint8_array(data))


def checksum_buffers(buffers: Iterable[Any], algo: str = DEFAULT_ALGORITHM) -> int:
    """Checksum of the concatenation of host buffers, hashed in place (not joined first).

    The incremental form of :func:`checksum`: a chunk read back or staged in several
    pieces is verified without copying it together.

    ``buffers`` is consumed one at a time, in order, and no buffer is read again once the
    next one is taken: a reader may pass a generator that fills each buffer just before
    yielding it, reusing scratch memory for the next (:mod:`pcframe.restore.reader` does).

    Args:
        buffers: bytes-like objects (memoryviews, ``bytes``, contiguous uint8 arrays), in order.
        algo: ``"pcf64"``, ``"crc32c"`` or ``"xxh3_64"``.
    """
    check_algorithm(algo)
    return _REGISTRY[algo][1](buffers)


def _word_sum(data, first_word: int) -> int:
    """pcf64 word sum of uint8 ``data`` (a whole number of words unless it is the end)."""
    from pcframe.kernels.dispatch import has_numba

    if has_numba() and data.size:
        from pcframe.kernels.checksum.numba_cpu import hash_bytes

        return int(hash_bytes(data.ctypes.data, data.size, first_word))
    return reference.pcf64_word_sum(data, first_word)


def pcf64_buffers(buffers: Iterable[Any]) -> int:
    """pcf64 of the concatenation of several host buffers, without concatenating them.

    A word may straddle two buffers (a reader fills a chunk from several tensors and
    padding); its bytes are joined in an 8-byte seam, everything else is hashed in place.

    Args:
        buffers: bytes-like objects or 1-D uint8 numpy arrays, in order.
    """
    import numpy as np

    total, words, nbytes, seam = 0, 0, 0, b""
    for buffer in buffers:
        data = as_uint8_array(buffer)
        nbytes += data.size
        if seam:
            take = data[: 8 - len(seam)]
            seam += take.tobytes()
            data = data[take.size :]
            if len(seam) < 8:
                continue
            total += _word_sum(np.frombuffer(seam, dtype=np.uint8), words)
            words, seam = words + 1, b""
        whole = data.size // 8
        if whole:
            total += _word_sum(data[: whole * 8], words)
            words += whole
        seam = data[whole * 8 :].tobytes()
    if seam:
        total += _word_sum(np.frombuffer(seam, dtype=np.uint8), words)
    return reference.pcf64_finalize(total, nbytes)


# The registry: every checksum pcframe knows, under the name the manifest records, with its
# digest width and its host implementation over a sequence of buffers. This is the one list
# of algorithm names: the engine's configuration and manifest parser take theirs from here.
_REGISTRY: dict[str, tuple[int, Callable[[Iterable[Any]], int]]] = {
    "pcf64": (64, pcf64_buffers),
    "crc32c": (32, reference.crc32c_buffers),
    "xxh3_64": (64, reference.xxh3_64_buffers),
}
ALGORITHMS: tuple[str, ...] = tuple(_REGISTRY)
DIGEST_BITS: dict[str, int] = {name: bits for name, (bits, _) in _REGISTRY.items()}
