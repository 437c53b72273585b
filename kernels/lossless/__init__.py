"""Lossless compression: a byte-shuffle kernel in front of zstandard.

zstd does the compressing (the ``zstandard`` library, which releases the GIL); the
kernels only regroup bytes so that it finds the redundancy in float data.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import zstandard

from pcframe.kernels._tensor_bytes import BytesLike, as_uint8_array, byte_view
from pcframe.kernels.dispatch import backend_module, resolve_backend

__all__ = ["ShuffleZstd", "shuffle_bytes", "unshuffle_bytes"]


def _check(data: torch.Tensor, itemsize: int) -> None:
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError("byte shuffle takes a contiguous 1-D torch.uint8 tensor")
    if itemsize < 1 or data.numel() % itemsize:
        raise ValueError(f"{data.numel()} bytes is not a whole number of {itemsize}-byte elements")


def _output(data: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(data)
    if out.dtype != torch.uint8 or out.shape != data.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 tensor of {data.numel()} bytes")
    if out.device != data.device:
        raise ValueError(f"out is on {out.device}, the data on {data.device}")
    return out


def shuffle_bytes(
    x: torch.Tensor,
    itemsize: int | None = None,
    *,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Byte planes of ``x``: ``out[k * n + i]`` = byte k of element i (1-D uint8).

    Args:
        x: Any tensor (its logical bytes are shuffled).
        itemsize: Element width in bytes; default ``x.element_size()`` (pass it to
            shuffle raw uint8 bytes that hold wider elements, e.g. an XOR delta).
        backend: ``"auto"``, ``"torch"``, ``"numba"`` or ``"triton"``.
        out: Optional preallocated 1-D uint8 output (reusing one saves page faults).
    """
    data = byte_view(x.detach().contiguous())
    itemsize = x.element_size() if itemsize is None else itemsize
    _check(data, itemsize)
    result = _output(data, out)
    if itemsize == 1:
        return result.copy_(data)
    impl = backend_module("lossless", resolve_backend(backend, x.device, op="shuffle_bytes"))
    impl.shuffle(data, itemsize, result)
    return result


def unshuffle_bytes(
    data: torch.Tensor, itemsize: int, *, backend: str = "auto", out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`shuffle_bytes`: element-major 1-D uint8 bytes."""
    _check(data, itemsize)
    result = _output(data, out)
    if itemsize == 1:
        return result.copy_(data)
    impl = backend_module("lossless", resolve_backend(backend, data.device, op="unshuffle_bytes"))
    impl.unshuffle(data, itemsize, result)
    return result


class ShuffleZstd:
    """Byte shuffle + zstd: a lossless tensor codec object.

    Args:
        level: zstd compression level (1 fastest .. 19; negative levels are faster still).
        threads: zstd worker threads per call (0: compress on the calling thread; the
            engine's own writer threads already run calls in parallel).
        shuffle: Whether to byte-shuffle elements wider than one byte first.
        backend: Backend of the encode-side shuffle (decoding always runs on the host).
    """

    def __init__(
        self, level: int = 3, *, threads: int = 0, shuffle: bool = True, backend: str = "auto"
    ) -> None:
        # Exactly what a reader's meta check accepts: a value it would refuse would make
        # every version written with it unreadable (True is an int to Python, not to JSON).
        if isinstance(level, bool) or not isinstance(level, int) or not -7 <= level <= 22:
            raise ValueError(f"zstd level must be an integer in [-7, 22], got {level!r}")
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be True or False, got {shuffle!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"zstd threads must be an integer >= 0, got {threads!r}")
        self.level = level
        self.threads = threads
        self.shuffle = shuffle
        self.backend = backend
        # zstd contexts are not safe to share between threads: one per thread.
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "compressor", None)
        if c is None:
            c = zstandard.ZstdCompressor(level=self.level, threads=self.threads)
            self._local.compressor = c
        return c

    def compress_bytes(self, data: BytesLike) -> bytes:
        """zstd frame (content size recorded) of raw bytes."""
        return self._compressor().compress(memoryview(as_uint8_array(data)))

    def compress(self, x: torch.Tensor, itemsize: int | None = None) -> bytes:
        """Shuffle (if enabled) and compress the logical bytes of ``x``.

        ``itemsize`` overrides the element width used by the shuffle (for raw bytes).
        """
        itemsize = x.element_size() if itemsize is None else itemsize
        if self.shuffle and itemsize > 1:
            data = shuffle_bytes(x, itemsize, backend=self.backend)
        else:
            data = byte_view(x.detach().contiguous())
        return self.compress_bytes(data.cpu())

    @staticmethod
    def decompress_bytes(payload: BytesLike, nbytes: int) -> torch.Tensor:
        """Decompress a zstd frame that must hold exactly ``nbytes`` bytes.

        Raises:
            ValueError: the payload is not a zstd frame (``zstandard.ZstdError`` included) or
                does not hold exactly ``nbytes`` bytes; nothing past ``nbytes`` is inflated.
        """
        data = memoryview(as_uint8_array(payload))
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise ValueError(f"payload is not a zstd frame ({exc})") from None
        if declared not in (-1, nbytes):  # -1: the frame does not record its size
            raise ValueError(
                f"zstd payload does not hold exactly {nbytes} bytes (its frame says {declared})"
            )
        # A frame that records its size (what compress_bytes writes) is read in place; one
        # that does not is read piece by piece, so a hostile one never makes us allocate
        # ``nbytes`` up front for what turns out to be a few bytes.
        known = declared == nbytes
        out = torch.empty(nbytes if known else 0, dtype=torch.uint8)
        pieces: list[bytes] = []
        try:
            with zstandard.ZstdDecompressor().stream_reader(data) as reader:
                filled = 0
                view = memoryview(out.numpy())
                while filled < nbytes:
                    if known:
                        got = reader.readinto(view[filled:])
                    else:
                        piece = reader.read(min(nbytes - filled, 1 << 20))
                        pieces.append(piece)
                        got = len(piece)
                    if got == 0:
                        break
                    filled += got
                extra = reader.read(1)
        except zstandard.ZstdError as exc:
            raise ValueError(f"zstd payload does not decompress ({exc})") from None
        if filled != nbytes or extra:
            raise ValueError(f"zstd payload does not hold exactly {nbytes} bytes")
        if not known and nbytes:
            out = torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.uint8)
        return out

    def decompress(
        self,
        payload: BytesLike,
        dtype: torch.dtype,
        shape: Sequence[int],
        *,
        shuffled: bool | None = None,
        itemsize: int | None = None,
    ) -> torch.Tensor:
        """Inverse of :meth:`compress`: a CPU tensor of ``dtype`` and ``shape``.

        ``shuffled`` says whether the payload was shuffled (default: this object's
        setting; codecs pass the value recorded at encode time); ``itemsize`` is the
        shuffle width if it was not ``dtype``'s.
        """
        width = torch.empty(0, dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= int(s)
        data = self.decompress_bytes(payload, numel * width)
        itemsize = width if itemsize is None else itemsize
        if (self.shuffle if shuffled is None else shuffled) and itemsize > 1:
            data = unshuffle_bytes(data, itemsize)  # decoded bytes are on the host
        return data.view(dtype).view(tuple(shape))
