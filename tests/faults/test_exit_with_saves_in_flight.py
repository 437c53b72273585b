"""A script that ends (or dies of an exception) with saves in flight must still exit promptly.

The atexit handler closes the Checkpointer and waits for the versions in flight. Those
versions must either commit or fail; they must not wait for writer threads the interpreter
has already shut down (``ThreadPoolExecutor.submit`` raises ``RuntimeError: cannot schedule
new futures after interpreter shutdown`` once ``threading._shutdown`` has run, which is
before atexit handlers). A multi-rank job whose peer died hits the same path: the survivor's
``save()`` raises, and the interpreter exits with the local version in flight.
"""

from __future__ import annotations

import subprocess

import pytest

from pcframe.restore.reader import load_version
from pcframe.store.directory import CheckpointDir

SCRIPT = r"""
import os, sys, torch
from pcframe import Checkpointer
from tests.stamp import StepStampOptimizer

model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
opt = StepStampOptimizer(model.parameters())
ckpt = Checkpointer(sys.argv[1], model=model, optimizer=opt, chunk_bytes=65536,
                    max_in_flight=2, writer_threads=2)
for step in range(1, 4):
    opt.step()
    ckpt.save(step)
print("in flight at exit:", ckpt._flight.in_flight_versions(), flush=True)
if os.environ.get("RAISE"):
    raise RuntimeError("the training loop crashed")
"""


@pytest.mark.parametrize("how", ["end_of_script", "uncaught_exception"])
@pytest.mark.slow
def test_exit_with_saves_in_flight_does_not_hang(tmp_path, python, child_env, how):
    env = dict(child_env, RAISE="1" if how == "uncaught_exception" else "")
    try:
        done = subprocess.run(
            [python, "-c", SCRIPT, str(tmp_path)],
            env=env, capture_output=True, text=True, timeout=15,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout
        raise AssertionError(
            f"the process hung at exit for 15 s with saves in flight ({out!r}); the atexit "
            "close waits (up to CLOSE_TIMEOUT_AT_EXIT=600 s) for a version whose chunk could "
            "not be handed to the already shut-down writer pool"
        ) from None
    assert "in flight at exit: [" in done.stdout
    assert done.returncode == (1 if how == "uncaught_exception" else 0), done.stderr[-2000:]
    directory = CheckpointDir(tmp_path)
    versions = directory.committed_versions()
    assert versions, "nothing committed"
    for version in versions:
        assert load_version(directory.path(version)).manifest.step == version
