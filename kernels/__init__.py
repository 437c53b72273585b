"""Copy, checksum and compression kernels (``pcframe.kernels``): Triton, Numba and torch.

One folder per operation (``copy``, ``checksum``, ``quantize``, ``delta``, ``lossless``,
``mmap_persist``), each with ``reference.py`` (plain torch / numpy: the specification
and the fallback), ``numba_cpu.py`` and ``triton_gpu.py``. Every public function takes
``backend="auto" | "torch" | "numba" | "triton"``: ``"auto"`` picks Triton for CUDA
tensors and Numba for CPU tensors; a backend named explicitly is used or raises.
"""

from pcframe.kernels.checksum import ALGORITHMS, DEFAULT_ALGORITHM, DIGEST_BITS, checksum
from pcframe.kernels.codecs import Codec, available_codecs, get_codec, register_codec
from pcframe.kernels.copy import Completion, Piece, gather, gather_checksum, scatter
from pcframe.kernels.delta import decode_delta, encode_delta
from pcframe.kernels.dispatch import BACKENDS, BackendUnavailableError, resolve_backend
from pcframe.kernels.lossless import ShuffleZstd, shuffle_bytes, unshuffle_bytes
from pcframe.kernels.mmap_persist import MappedFile, flush_mmap, persist_chunk_mmap
from pcframe.kernels.quantize import QuantizedTensor, dequantize_blockwise, quantize_blockwise

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "DEFAULT_ALGORITHM",
    "DIGEST_BITS",
    "BackendUnavailableError",
    "Codec",
    "Completion",
    "MappedFile",
    "Piece",
    "QuantizedTensor",
    "ShuffleZstd",
    "available_codecs",
    "checksum",
    "decode_delta",
    "dequantize_blockwise",
    "encode_delta",
    "flush_mmap",
    "gather",
    "gather_checksum",
    "get_codec",
    "persist_chunk_mmap",
    "quantize_blockwise",
    "register_codec",
    "resolve_backend",
    "scatter",
    "shuffle_bytes",
    "unshuffle_bytes",
]
