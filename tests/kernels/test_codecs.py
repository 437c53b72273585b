"""Codecs: JSON-only meta, bit-exact lossless round trips, lossy ones within their bound."""

from __future__ import annotations

import json

import pytest
import torch

from pcframe.kernels import available_codecs, get_codec, register_codec
from pcframe.kernels.codecs import FORMAT_VERSION, Codec, RawCodec

from .helpers import DTYPES, FLOAT_DTYPES, logical_bytes, make, same_bits

LOSSLESS = ["raw", "zstd", "xor_delta_zstd"]
LOSSY = ["int8_block", "fp8_block"]


def _through_json(meta: dict) -> dict:
    text = json.dumps(meta)  # raises on anything that is not plain JSON
    back = json.loads(text)
    assert back == meta
    return back


def _roundtrip(name: str, x: torch.Tensor, previous: torch.Tensor | None = None, **config):
    payload, meta = get_codec(name, **config).encode(x, previous=previous)
    assert isinstance(payload, memoryview) and payload.format == "B"
    meta = _through_json(meta)
    assert meta["format_version"] == FORMAT_VERSION
    stored = bytes(payload)  # what a file read would give back
    fresh = get_codec(name)  # decoding must not depend on the encoder's settings
    return fresh.decode(stored, meta, x.dtype, x.shape, previous=previous), meta, len(stored)


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "strided"), [((0,), False), ((), False), ((1001,), False), ((4, 9), True)]
)
def test_lossless_codecs_roundtrip_bit_exact(name, dtype, shape, strided) -> None:
    x = make(dtype, shape, seed=5, strided=strided)
    prev = make(dtype, shape, seed=6) if name == "xor_delta_zstd" else None
    back, _, _ = _roundtrip(name, x, prev, **({"level": 1} if name != "raw" else {}))
    assert same_bits(back, x)


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "strided"), [((0,), False), ((1001,), False), ((4, 90), True)])
def test_lossy_codecs_stay_within_recorded_bound(name, dtype, shape, strided) -> None:
    x = make(dtype, shape, seed=7, strided=strided)
    back, meta, nbytes = _roundtrip(name, x, block_size=128)
    assert back.dtype == dtype and back.shape == x.shape
    err = (back.double() - x.double()).abs().max().item() if x.numel() else 0.0
    assert err <= meta["error_bound"]
    assert meta["block_size"] == 128 and meta["source_dtype"] == str(dtype).removeprefix("torch.")
    # ~1 byte per element plus 4 bytes per block: smaller than the source.
    assert nbytes <= x.numel() + 4 * meta["n_blocks"] + 3


def test_lossy_codec_rejects_integer_tensors() -> None:
    with pytest.raises(ValueError, match="block quantization takes"):
        get_codec("int8_block").encode(torch.arange(10))


def test_xor_delta_needs_previous_and_shrinks_unchanged_data() -> None:
    x = make(torch.float32, (1 << 16,), seed=8)
    codec = get_codec("xor_delta_zstd")
    with pytest.raises(ValueError, match="previous"):
        codec.encode(x)
    nearly = x.clone()
    nearly[::1000] += 1.0
    back, _, nbytes = _roundtrip("xor_delta_zstd", nearly, x)
    assert same_bits(back, nearly)
    assert nbytes < 0.05 * x.numel() * 4
    payload, meta = codec.encode(nearly, previous=x)
    with pytest.raises(ValueError, match="previous"):
        codec.decode(payload, meta, x.dtype, x.shape)


def test_decode_into_out_on_any_layout() -> None:
    x = make(torch.bfloat16, (6, 10), seed=9)
    for name in ("raw", "zstd", "int8_block"):
        codec = get_codec(name)
        payload, meta = codec.encode(x)
        out = torch.empty(10, 6, dtype=torch.bfloat16).t()
        assert codec.decode(payload, meta, x.dtype, x.shape, out=out) is out
        ref = codec.decode(payload, meta, x.dtype, x.shape)
        assert same_bits(out, ref)
    with pytest.raises(ValueError, match="out must be"):
        codec.decode(payload, meta, x.dtype, x.shape, out=torch.empty(60, dtype=torch.bfloat16))


def test_raw_payload_is_the_logical_bytes_and_checks_size() -> None:
    x = make(torch.int32, (3, 4), seed=10, strided=True)
    payload, meta = get_codec("raw").encode(x)
    assert bytes(payload) == logical_bytes(x).tobytes() and meta["nbytes"] == 48
    with pytest.raises(ValueError, match="needs 40"):
        get_codec("raw").decode(bytes(payload), meta, torch.int32, (10,))


def test_meta_from_another_format_version_is_rejected() -> None:
    payload, meta = get_codec("zstd").encode(torch.zeros(4))
    with pytest.raises(ValueError, match="format_version"):
        get_codec("zstd").decode(payload, meta | {"format_version": 99}, torch.float32, (4,))
    with pytest.raises(ValueError, match="'shuffle'"):
        get_codec("zstd").decode(payload, {"format_version": FORMAT_VERSION}, torch.float32, (4,))


def test_registry() -> None:
    assert set(LOSSLESS + LOSSY) <= set(available_codecs())
    assert get_codec("raw").lossless and not get_codec("fp8_block").lossless
    assert get_codec("zstd", level=5).config()["level"] == 5
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("lz4")

    class Duplicate(RawCodec):
        name = "raw"

    with pytest.raises(ValueError, match="already registered"):
        register_codec(Duplicate)
    assert issubclass(Duplicate, Codec)
