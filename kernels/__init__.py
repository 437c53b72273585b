"""Copy, checksum and compression kernels (``pcframe.kernels``): Triton, Numba and torch.

One folder per operation (``copy``, ``checksum``, ``quantize``, ``delta``, ``lossless``,
``mmap_persist``), each with ``reference.py`` (plain torch / numpy: the specification
and the fallback), ``numba_cpu.py`` and ``triton_gpu.py``. Every public function takes
``backend="auto" | "torch" | "numba" | "triton"``: ``"auto"`` picks Triton for CUDA
tensors and Numba for CPU tensors; a backend named explicitly is used or raises.

This folder installs as ``pcframe.kernels`` only. Run from the repository's root, Python
would also find it as a top-level ``kernels``, the name of Hugging Face's kernel package
(which transformers imports when it is installed): that import is handed to the installed
package, or fails as if this folder were not there (``_not_top_level``).
"""

import sys

if __name__ == "kernels":  # found from the repository's root as a bare top-level name

    def _not_top_level() -> None:
        import importlib.machinery
        import importlib.util
        import os

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
        del sys.modules["kernels"]
        if spec is None or spec.loader is None:
            raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module  # the import statement returns what this names
        spec.loader.exec_module(module)

    _not_top_level()  # the rest of this file runs on into a module no name refers to

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
