"""CUDA-only tests (``gpu`` marker); each names its CPU twin, which runs everywhere.

The twins exercise the same Triton kernels through the interpreter on CPU. On a CUDA
machine those cannot run in this process (Triton compiles for the GPU there), so
``test_triton_interpreter_suite`` replays them in a child process with the GPU hidden.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pcframe.kernels import (
    checksum,
    decode_delta,
    dequantize_blockwise,
    encode_delta,
    gather,
    gather_checksum,
    quantize_blockwise,
    scatter,
    shuffle_bytes,
)
from pcframe.kernels.checksum import reference as checksum_ref

from .helpers import HAS_CUDA, logical_bytes, make, same_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]


def _cuda_layout() -> tuple[list[torch.Tensor], list[tuple], int]:
    ts = [
        make(torch.float32, (4099,), seed=1).cuda(),
        make(torch.bfloat16, (17, 33), seed=2, strided=True).cuda(),
        make(torch.int64, (5,), seed=3).cuda(),
        make(torch.bool, (9,), seed=4).cuda(),
    ]
    pieces, off = [], 0
    for t in ts:
        n = t.numel() * t.element_size()
        pieces.append((t, 0, off, n))
        off += -(-n // 64) * 64
    return ts, pieces, off


def test_fused_gather_to_pinned_memory_runs_on_side_stream() -> None:
    """Twin: test_copy.py::test_gather_checksum_is_checksum_of_written_buffer."""
    _, pieces, size = _cuda_layout()
    dst = torch.full((size + 5,), 0xAB, dtype=torch.uint8).pin_memory()
    done = gather_checksum(pieces, dst, backend="triton")
    assert done.event is not None
    done.block_stream()  # the optimizer-step gate: a GPU-side wait
    value = done.result()
    expected = np.zeros(size + 5, dtype=np.uint8)
    for t, _, off, n in pieces:
        expected[off : off + n] = logical_bytes(t)
    assert np.array_equal(dst.numpy(), expected)
    assert value == checksum_ref.pcf64(expected)


def test_plain_gather_and_torch_backend_agree_on_cuda() -> None:
    """Twin: test_copy.py::test_gather_writes_logical_bytes_and_leaves_gaps."""
    _, pieces, size = _cuda_layout()
    outs = []
    for backend in ("triton", "torch"):
        dst = torch.full((size,), 0xAB, dtype=torch.uint8).pin_memory()
        gather(pieces, dst, backend=backend).wait()
        outs.append(dst.numpy().copy())
    assert np.array_equal(outs[0], outs[1])


def test_scatter_from_pinned_memory_restores_cuda_tensors() -> None:
    """Twin: test_copy.py::test_chunked_gather_then_scatter_restores_bits."""
    ts, pieces, size = _cuda_layout()
    dst = torch.empty(size, dtype=torch.uint8).pin_memory()
    gather(pieces, dst, backend="triton", zero_fill=True).wait()
    targets = [torch.empty_like(t) for t in ts]
    back = [(tt, a, b, n) for tt, (_, a, b, n) in zip(targets, pieces, strict=True)]
    scatter(dst, back, backend="triton").wait()
    assert all(same_bits(a, b) for a, b in zip(targets, ts, strict=True))


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_quantize_on_cuda_is_bit_exact_with_reference(fmt: str, dtype: torch.dtype) -> None:
    """Twin: test_quantize.py::test_backends_are_bit_exact_with_reference."""
    x = make(dtype, (3001,), seed=5)
    want = quantize_blockwise(x, fmt, 256, backend="torch")
    got = quantize_blockwise(x.cuda(), fmt, 256, backend="triton")
    assert torch.equal(got.codes.cpu(), want.codes)
    assert torch.equal(got.scales.cpu(), want.scales)
    assert torch.equal(dequantize_blockwise(got).cpu(), dequantize_blockwise(want))


def test_delta_shuffle_and_checksum_on_cuda_match_cpu() -> None:
    """Twins: test_delta_roundtrip_is_bit_exact, test_shuffle_layout_and_inverse,
    test_pcf64_backends_match_reference."""
    prev, cur = make(torch.float32, (1000,), seed=6), make(torch.float32, (1000,), seed=7)
    delta = encode_delta(cur.cuda(), prev.cuda(), backend="triton")
    assert torch.equal(delta.cpu(), encode_delta(cur, prev, backend="torch"))
    assert same_bits(decode_delta(delta, prev.cuda(), backend="triton").cpu(), cur)
    assert torch.equal(shuffle_bytes(cur.cuda(), backend="triton").cpu(), shuffle_bytes(cur))
    data = delta[3:]
    assert checksum(data, backend="triton") == checksum_ref.pcf64(data.cpu().numpy())


@pytest.mark.slow
def test_triton_interpreter_suite() -> None:
    """The Triton-on-CPU tests in a child process where CUDA is hidden."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider"]
    cmd += ["-m", "not gpu", "-k", "triton"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
