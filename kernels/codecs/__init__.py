"""Named tensor codecs: what the engine records per tensor in its JSON manifest.

``encode(tensor) -> (payload, meta)`` and ``decode(payload, meta, dtype, shape)``; the
payload is a bytes-like ``memoryview`` and ``meta`` holds only JSON types (no pickle
anywhere), and everything decoding needs is in ``meta``, so any instance of a codec
decodes what any other instance encoded. The default, ``"raw"``, is bit-exact.

=================  ========  ===============================================
name               lossless  payload
=================  ========  ===============================================
``raw``            yes       the logical bytes
``zstd``           yes       byte shuffle + zstd
``xor_delta_zstd`` yes       zstd(shuffle(bytes XOR previous version's bytes))
``int8_block``     no        int8 codes, then fp32 per-block scales
``fp8_block``      no        e4m3fn codes, then fp32 per-block scales
=================  ========  ===============================================
"""

from pcframe.kernels.codecs.base import (
    FORMAT_VERSION,
    Codec,
    available_codecs,
    get_codec,
    register_codec,
)
from pcframe.kernels.codecs.exact import RawCodec, XorDeltaZstdCodec, ZstdCodec
from pcframe.kernels.codecs.quantized import Fp8BlockCodec, Int8BlockCodec
from pcframe.kernels.dtypes import dtype_name

__all__ = [
    "FORMAT_VERSION",
    "Codec",
    "Fp8BlockCodec",
    "Int8BlockCodec",
    "RawCodec",
    "XorDeltaZstdCodec",
    "ZstdCodec",
    "available_codecs",
    "dtype_name",
    "get_codec",
    "register_codec",
]
