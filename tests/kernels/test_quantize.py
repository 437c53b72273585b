"""Block quantization: bit-exact backends, rounding rules, and the recorded error bound."""

from __future__ import annotations

import pytest
import torch

from pcframe.kernels import QuantizedTensor, dequantize_blockwise, quantize_blockwise
from pcframe.kernels.quantize import FORMATS

from .helpers import CPU_BACKENDS, FAST_BACKENDS, FLOAT_DTYPES, make


def _per_block_error(x: torch.Tensor, q: QuantizedTensor, y: torch.Tensor) -> torch.Tensor:
    err = (x.double().reshape(-1) - y.double().reshape(-1)).abs()
    nb = q.scales.numel()
    err = torch.nn.functional.pad(err, (0, nb * q.block_size - err.numel()))
    return err.view(nb, q.block_size).amax(dim=1)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "strided"), [((0,), False), ((1,), False), ((1000,), False), ((7, 37), True)]
)
def test_backends_are_bit_exact_with_reference(backend, fmt, dtype, shape, strided) -> None:
    x = make(dtype, shape, seed=sum(shape), strided=strided)
    if x.numel() > 300:
        x.view(-1)[256:512] = 0  # an all-zero block
    want = quantize_blockwise(x, fmt, 256, backend="torch")
    got = quantize_blockwise(x, fmt, 256, backend=backend)
    assert got.codes.dtype == want.codes.dtype == (torch.int8 if fmt == "int8" else torch.uint8)
    assert torch.equal(got.codes, want.codes)
    assert torch.equal(got.scales, want.scales)
    assert torch.equal(got.error_bound, want.error_bound)
    back, ref = (
        dequantize_blockwise(got, backend=backend),
        dequantize_blockwise(want, backend="torch"),
    )
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.equal(back, ref)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_error_stays_within_recorded_bound(backend: str, fmt: str, dtype: torch.dtype) -> None:
    wild = make(dtype, (2000,), seed=11)  # magnitudes spread over 2**-20 .. 2**12
    q = quantize_blockwise(wild, fmt, 100, backend=backend)
    err = _per_block_error(wild, q, dequantize_blockwise(q, backend=backend))
    assert (err <= q.error_bound.double()).all()
    assert q.max_error == float(q.error_bound.max())
    # On Gaussian data the bound is also tight: near the largest error actually made.
    x = torch.randn(2000, generator=torch.Generator().manual_seed(12)).to(dtype)
    q = quantize_blockwise(x, fmt, 100, backend=backend)
    err = _per_block_error(x, q, dequantize_blockwise(q, backend=backend))
    assert (err <= q.error_bound.double()).all()
    assert (err >= 0.3 * q.error_bound.double()).float().mean() > 0.8


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_bound_holds_where_fp16_values_are_subnormal(backend: str, fmt: str) -> None:
    """Below 6.1e-5 (Adam's exp_avg_sq) the cast back to fp16 rounds to an absolute step of
    2**-24, which a relative bound misses: errors reached 1.26x the recorded bound."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(65536, generator=gen) * 1e-6).to(torch.float16)
    q = quantize_blockwise(x, fmt, 64, backend=backend)
    err = _per_block_error(x, q, dequantize_blockwise(q, backend=backend))
    assert (err <= q.error_bound.double()).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_of_tiny_values_keep_their_signs_and_the_bound(backend: str, fmt: str) -> None:
    """Below ~3.7e-37 (int8) qmax / absmax overflowed to inf: every code became -127, signs
    flipped and zeros came back as -absmax, 500x over the recorded bound."""
    x = torch.tensor([1e-37, -1e-38, 0.0, 5e-38, 3e-45, -2e-40] * 10, dtype=torch.float32)
    q = quantize_blockwise(x, fmt, 32, backend=backend)
    back = dequantize_blockwise(q, backend=backend)
    err = _per_block_error(x, q, back)
    assert (err <= q.error_bound.double()).all()
    assert (torch.sign(back) == torch.sign(x))[x.abs() > 1e-39].all()
    assert (back[x == 0] == 0).all()
    reference = quantize_blockwise(x, fmt, 32, backend="torch")
    assert torch.equal(q.codes, reference.codes) and torch.equal(q.scales, reference.scales)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_int8_rounds_half_to_even(backend: str) -> None:
    # absmax 127 makes the scale exactly 1, so the codes are the rounded inputs.
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -126.5])
    q = quantize_blockwise(x, "int8", 16, backend=backend)
    assert q.scales.tolist() == [1.0]
    assert q.codes.tolist() == [127, 0, 2, 2, 0, -2, -2, 3, -126]


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_fp8_roundtrips_every_code_and_rounds_midpoints_to_even(backend: str) -> None:
    # absmax 448 makes the scale exactly 1: inputs are fp8 values and their midpoints.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    values = finite.view(torch.float8_e4m3fn).float()
    q = quantize_blockwise(values, "fp8_e4m3", 1024, backend=backend)
    assert torch.equal(q.codes, finite)
    pos = values[(values > 0) & (values < 448)].sort().values
    mids = torch.cat([(pos[:-1] + pos[1:]) / 2, torch.tensor([448.0])])
    want = quantize_blockwise(mids, "fp8_e4m3", 1024, backend="torch").codes
    got = quantize_blockwise(mids, "fp8_e4m3", 1024, backend=backend).codes
    assert torch.equal(got, want)
    assert (got[:-1] & 1 == 0).all()  # every tie went to the even mantissa
    nudged = torch.nextafter(mids[:-1], torch.full_like(mids[:-1], 1e9))
    up = quantize_blockwise(
        torch.cat([nudged, torch.tensor([448.0])]), "fp8_e4m3", 1024, backend=backend
    )
    assert torch.equal(up.codes[:-1], finite[(finite > 0) & (finite < 0x7E)][1:])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected_naming_the_block(backend: str, bad: float) -> None:
    x = torch.ones(600)
    x[300] = bad
    with pytest.raises(ValueError, match="block 1"):
        quantize_blockwise(x, "int8", 256, backend=backend)


def test_zero_blocks_quantize_to_zero() -> None:
    q = quantize_blockwise(torch.zeros(300), "fp8_e4m3", 256)
    assert not q.codes.any() and not q.scales.any() and q.max_error == 0.0
    assert not dequantize_blockwise(q).any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"x": torch.zeros(4, dtype=torch.int32)}, "block quantization takes"),
        ({"x": torch.zeros(4, dtype=torch.float64)}, "block quantization takes"),
        ({"fmt": "int4"}, "unknown quantization format"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict, message: str) -> None:
    args = {"x": torch.zeros(4), "fmt": "int8", "block_size": 256} | kwargs
    with pytest.raises(ValueError, match=message):
        quantize_blockwise(args["x"], args["fmt"], args["block_size"])


def test_dequantize_into_out() -> None:
    x = make(torch.bfloat16, (3, 50), seed=5)
    q = quantize_blockwise(x, "int8", 64)
    out = torch.empty(3, 50, dtype=torch.bfloat16)
    assert dequantize_blockwise(q, out=out) is out
    assert torch.equal(out, dequantize_blockwise(q, backend="torch"))
    with pytest.raises(ValueError, match="out must have"):
        dequantize_blockwise(q, out=torch.empty(150, dtype=torch.bfloat16))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_quantize_into_reused_buffers(backend: str) -> None:
    x = make(torch.float32, (600,), seed=13)
    codes = torch.full((600,), 3, dtype=torch.int8)
    scales = torch.full((3,), 9.0)
    q = quantize_blockwise(x, "int8", 256, backend=backend, out=(codes, scales))
    want = quantize_blockwise(x, "int8", 256, backend="torch")
    assert q.codes.data_ptr() == codes.data_ptr() and q.scales is scales
    assert torch.equal(codes, want.codes) and torch.equal(scales, want.scales)
    with pytest.raises(ValueError, match="out scales"):
        quantize_blockwise(x, "int8", 256, backend=backend, out=(codes, torch.empty(2)))
