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


# The longest files of the default run (``pytest --durations=0``, summed per file), run
# first: xdist hands out whole files in collection order, and a long file handed out last
# kept one worker busy for minutes after the others had finished.
LONG_FILES = (
    "tests/integrations/test_transformers_ranks.py",
    "tests/integrations/test_lightning_ddp.py",
    "tests/sim/test_path_agreement.py",
    "tests/distributed/test_multirank.py",
    "tests/apps/test_tune.py",
    "tests/apps/test_errors.py",
    "tests/faults/test_crash_matrix.py",
    "tests/faults/test_hostile_directories.py",
    "tests/apps/test_run_output.py",
    "tests/integrations/test_transformers.py",
    "tests/integrations/test_lightning.py",
    "tests/apps/test_targets.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = Path(str(item.path)).relative_to(REPO).as_posix()
        return LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: the order within a file and among the rest is kept


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for child Python processes: one thread, the repo importable."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # Child scripts import shared test helpers (``tests.stamp``) from the repository.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("PCFRAME_CRASH_AT", None)
    return env


@pytest.fixture
def python() -> str:
    return sys.executable
