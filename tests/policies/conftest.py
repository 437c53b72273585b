"""Shared fixtures of the policy tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from pcframe.policies.traces import shared_traces_dir


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The shipped traces; tests that need them skip (with the reason) where they are absent."""
    path = shared_traces_dir()
    if path is None:
        pytest.skip(
            "no trace directory: copy shared/traces to experiments/traces or set PCFRAME_TRACES"
        )
    return path
