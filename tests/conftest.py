"""Shared test helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# Triton reads TRITON_INTERPRET when it is first imported and when kernels are decorated.
# Set it here, before any test module is collected: some collected modules import libraries
# (lightning, transformers) that import triton, which then would compile for a GPU that is
# not there (tests/kernels/conftest.py is collected too late for that).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for child Python processes: one thread, the repo importable."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # Child scripts import shared test helpers (``tests.engine.stamp``) from the repository.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("PCFRAME_CRASH_AT", None)
    return env


@pytest.fixture
def python() -> str:
    return sys.executable
