"""A script that ends (or dies of an exception) with saves in flight must still exit promptly.

The atexit handler closes the Checkpointer and waits for the versions in flight. Those
versions must either commit or fail; they must not wait for writer threads the interpreter
has already shut down (``ThreadPoolExecutor.submit`` raises ``RuntimeError: cannot schedule
new futures after interpreter shutdown`` once ``threading._shutdown`` has run, which is
before atexit handlers). A multi-rank job whose peer died hits the same path: the survivor's
``save()`` raises, and the interpreter exits with the local version in flight.
"""

from __future__ import annotations

import queue
import subprocess
import threading

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


# The bound is on the exit alone, from the line the script prints after its last save():
# the hang it guards against is CLOSE_TIMEOUT_AT_EXIT (600 s). The interpreter's start, the
# torch import and the saves come before that line: on a busy 2-core machine they took more
# than the 15 s this test once gave the whole process, which failed it with nothing printed.
START = 300.0
EXIT = 60.0


@pytest.mark.parametrize("how", ["end_of_script", "uncaught_exception"])
@pytest.mark.slow
def test_exit_with_saves_in_flight_does_not_hang(tmp_path, python, child_env, how):
    env = dict(child_env, RAISE="1" if how == "uncaught_exception" else "")
    root, errors = tmp_path / "ckpt", tmp_path / "stderr.txt"
    with errors.open("w") as stderr:
        proc = subprocess.Popen(
            [python, "-c", SCRIPT, str(root)], env=env, stdout=subprocess.PIPE, stderr=stderr,
            text=True,
        )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        try:
            line = lines.get(timeout=START)
        except queue.Empty:
            raise AssertionError(f"the script printed nothing in {START:.0f} s") from None
        assert line is not None and line.startswith("in flight at exit: ["), (
            line,
            errors.read_text()[-2000:],
        )
        try:
            code = proc.wait(timeout=EXIT)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the process hung at exit for {EXIT:.0f} s with saves in flight ({line!r}); "
                "the atexit close waits (up to CLOSE_TIMEOUT_AT_EXIT=600 s) for a version "
                "whose chunk could not be handed to the already shut-down writer pool"
            ) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == (1 if how == "uncaught_exception" else 0), errors.read_text()[-2000:]
    directory = CheckpointDir(root)
    versions = directory.committed_versions()
    assert versions, "nothing committed"
    for version in versions:
        assert load_version(directory.path(version)).manifest.step == version
