"""Backend selection shared by every kernel op.

``"auto"`` picks Triton for CUDA tensors and Numba for CPU tensors (falling back to the
torch reference only when the preferred backend is not installed, because nobody asked
for it by name). A backend requested by name is used or an error is raised: no silent
fallback, and the error names what to install.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType
from typing import Literal

import torch

Backend = Literal["auto", "torch", "numba", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "numba", "triton")

# The package's import name; kernel modules are imported lazily by dotted name from here.
_PACKAGE = __name__.rpartition(".")[0]
_MODULE_OF = {"torch": "reference", "numba": "numba_cpu", "triton": "triton_gpu"}


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here (not installed or wrong device)."""


@functools.cache
def has_numba() -> bool:
    """Whether Numba can be imported (it is a core dependency, so normally True)."""
    try:
        import numba  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def has_triton() -> bool:
    """Whether the ``triton`` package is installed (the ``pcframe[gpu]`` extra)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_backend(
    backend: str,
    device: torch.device | str,
    *,
    op: str,
    supported: tuple[str, ...] = ("torch", "numba", "triton"),
) -> str:
    """Return the concrete backend (``"torch"``, ``"numba"`` or ``"triton"``) for one call.

    Args:
        backend: ``"auto"`` or a backend name.
        device: Device of the tensors the kernel works on (CUDA if any is on CUDA).
        op: Operation name, used in error messages.
        supported: Backends that ``op`` implements.

    Raises:
        ValueError: Unknown backend name, a backend ``op`` does not implement, or a device
            the backend cannot work on.
        BackendUnavailableError: The requested backend is not installed.
    """
    device = torch.device(device)
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        if device.type == "cuda" and "triton" in supported and has_triton():
            return "triton"
        if device.type == "cpu" and "numba" in supported and has_numba():
            return "numba"
        return "torch"
    if backend not in supported:
        raise ValueError(f"{op}: no {backend!r} backend; it supports {supported}")
    if backend == "numba":
        if not has_numba():
            raise BackendUnavailableError(
                f"{op}: backend='numba' requested but numba cannot be imported; "
                "reinstall pcframe (`pip install pcframe`), numba is a core dependency"
            )
        if device.type != "cpu":
            raise ValueError(
                f"{op}: backend='numba' works on CPU tensors, got {device.type}; "
                "use backend='triton' or 'auto' for CUDA tensors"
            )
    if backend == "triton":
        if not has_triton():
            raise BackendUnavailableError(
                f"{op}: backend='triton' requested but triton is not installed; "
                "install the GPU extra: `pip install pcframe[gpu]`"
            )
        if device.type != "cuda" and not (device.type == "cpu" and triton_interpreting()):
            raise ValueError(
                f"{op}: backend='triton' needs CUDA tensors, got {device.type}; to debug "
                "on CPU set TRITON_INTERPRET=1 before triton is imported"
            )
    return backend


def backend_module(op: str, backend: str) -> ModuleType:
    """Import (once) and return the implementation module of ``op`` for ``backend``."""
    return importlib.import_module(f"{_PACKAGE}.{op}.{_MODULE_OF[backend]}")


def common_device(*tensors: torch.Tensor) -> torch.device:
    """The device a kernel call runs on: the CUDA device if any tensor is on CUDA."""
    if all(t.is_cpu for t in tensors):  # the common case, without building device objects
        return torch.device("cpu")
    kinds = {t.device.type for t in tensors}
    cuda = {t.device for t in tensors if t.is_cuda}
    if len(cuda) > 1:
        raise ValueError(f"tensors are on several CUDA devices: {sorted(map(str, cuda))}")
    if cuda:
        return cuda.pop()
    return torch.device((kinds - {"cpu"}).pop())
