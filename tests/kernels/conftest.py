"""Kernel tests: run Triton kernels through its CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is decorated, and the
kernel modules are imported lazily on first use, so setting it here (before any test
runs) is early enough. On a CUDA machine Triton compiles for real instead: the ``gpu``
tests run, and ``test_gpu.py`` replays the interpreter tests in a child process.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
