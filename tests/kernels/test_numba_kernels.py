"""Numba kernels release the GIL and are cached, and stay correct under concurrent calls."""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from numba.core.registry import CPUDispatcher

from pcframe.kernels import checksum, gather_checksum
from pcframe.kernels.checksum import reference

MODULES = [
    "pcframe.kernels.copy.numba_cpu",
    "pcframe.kernels.checksum.numba_cpu",
    "pcframe.kernels.quantize.numba_cpu",
    "pcframe.kernels.delta.numba_cpu",
    "pcframe.kernels.lossless.numba_cpu",
    "pcframe.kernels.mmap_persist.numba_cpu",
]


@pytest.mark.parametrize("module", MODULES)
def test_every_numba_kernel_is_nogil_cached_and_serial(module: str) -> None:
    mod = importlib.import_module(module)
    kernels = [v for v in vars(mod).values() if isinstance(v, CPUDispatcher)]
    assert kernels, f"{module} defines no Numba kernels"
    for k in kernels:
        assert k.targetoptions.get("nogil") is True, k
        assert type(k._cache).__name__ == "FunctionCache", k  # cache=True (NullCache if not)
        assert not k.targetoptions.get("parallel"), k


def test_concurrent_fused_gathers_are_correct() -> None:
    """Writer threads gathering different chunks of one staging buffer at once."""
    rng = np.random.default_rng(0)
    src = torch.from_numpy(rng.integers(0, 256, 8 << 20, dtype=np.uint8))
    staging = torch.empty_like(src)
    chunk = 1 << 20

    def work(i: int) -> int:
        view = staging[i * chunk : (i + 1) * chunk]
        return gather_checksum([(src, i * chunk, 0, chunk)], view, backend="numba").result()

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(work, range(8)))
    assert torch.equal(staging, src)
    want = [reference.pcf64(src[i * chunk : (i + 1) * chunk].numpy()) for i in range(8)]
    assert got == want
    assert checksum(staging[:chunk], backend="numba") == want[0]
