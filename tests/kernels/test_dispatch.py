"""Backend selection: auto picks by device, explicit requests never fall back silently."""

from __future__ import annotations

import pytest
import torch

from pcframe.kernels import (
    BackendUnavailableError,
    dispatch,
    gather,
    quantize_blockwise,
    resolve_backend,
)


def test_auto_picks_numba_for_cpu_and_triton_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_backend("auto", "cpu", op="t") == "numba"
    monkeypatch.setattr(dispatch, "has_triton", lambda: True)
    assert resolve_backend("auto", "cuda", op="t") == "triton"
    assert resolve_backend("auto", "cuda", op="t", supported=("torch", "numba")) == "torch"


def test_auto_without_triton_uses_torch_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "has_triton", lambda: False)
    assert resolve_backend("auto", "cuda", op="t") == "torch"


def test_explicit_triton_without_triton_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "has_triton", lambda: False)
    with pytest.raises(BackendUnavailableError, match=r"pip install pcframe\[gpu\]"):
        resolve_backend("triton", "cuda", op="gather")
    with pytest.raises(BackendUnavailableError, match=r"pcframe\[gpu\]"):
        gather([], torch.zeros(8, dtype=torch.uint8), backend="triton")


def test_explicit_numba_without_numba_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "has_numba", lambda: False)
    with pytest.raises(BackendUnavailableError, match="numba"):
        quantize_blockwise(torch.ones(4), backend="numba")
    assert resolve_backend("auto", "cpu", op="t") == "torch"


def test_backend_device_mismatch_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="CPU tensors"):
        resolve_backend("numba", "cuda", op="t")
    monkeypatch.setattr(dispatch, "has_triton", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", "cpu", op="t")


def test_unknown_or_unsupported_backend_raises() -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("cuda", "cpu", op="t")
    with pytest.raises(ValueError, match="no 'triton' backend"):
        resolve_backend("triton", "cpu", op="t", supported=("torch",))


def test_common_device_of_cpu_and_other_devices() -> None:
    assert dispatch.common_device(torch.zeros(1)).type == "cpu"
    assert dispatch.common_device(torch.zeros(1), torch.zeros(1, device="meta")).type == "meta"
