"""SIGKILL during delta retention: every committed version still verifies with its base chain.

With ``keep_last=1`` a new full version makes its whole predecessor chain deletable at once.
Retention must delete dependents before their bases, so a kill between two deletions never
leaves a listed delta version whose base is gone.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time

import pytest

from pcframe.restore.reader import load_version
from pcframe.store.directory import CheckpointDir

SAVER = r"""
import sys, torch
from pcframe import Checkpointer
from tests.stamp import StepStampOptimizer

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
opt = StepStampOptimizer(model.parameters())
with Checkpointer(sys.argv[1], model=model, optimizer=opt, chunk_bytes=8192, keep_last=1,
                  codecs={"model/*": "xor_delta_zstd"}, full_every=4) as ckpt:
    step = ckpt.restore() or 0
    opt.count = step
    print("ready", step, flush=True)
    first = True
    while True:
        step += 1
        opt.step()
        ckpt.save(step).wait()
        if first:  # the kill window starts here, so a slow start (a loaded CI) kills nothing
            print("saved", step, flush=True)
            first = False
"""


def every_version_verifies(root) -> list[int]:
    directory = CheckpointDir(root)
    versions = directory.committed_versions()
    for version in versions:
        loaded = load_version(directory.path(version))  # follows and verifies the base chain
        step = loaded.manifest.step
        model = [t for e, t in zip(loaded.manifest.entries, loaded.tensors, strict=True)]
        assert all(float(t.flatten()[0]) == step for t in model if t.is_floating_point())
    return versions


def run(python, env, root, seconds: float | None) -> int:
    proc = subprocess.Popen(
        [python, "-c", SAVER, str(root)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready"), line
        if seconds is None:
            return proc.wait(timeout=120)
        line = proc.stdout.readline()
        assert line.startswith("saved"), line
        time.sleep(seconds)
        proc.send_signal(signal.SIGKILL)
        return proc.wait(timeout=60)
    finally:
        proc.stdout.close()


@pytest.mark.parametrize(
    "nth",
    [
        1,
        3,
        pytest.param(2, marks=pytest.mark.campaign),
        pytest.param(5, marks=pytest.mark.campaign),
    ],
)
@pytest.mark.slow
def test_kill_between_retention_deletes(tmp_path, python, child_env, nth):
    for point in ("trash_renamed", "retention"):
        env = dict(child_env, PCFRAME_CRASH_AT=f"{point}:{nth}")
        assert run(python, env, tmp_path, None) == -signal.SIGKILL  # crashed there itself
        assert every_version_verifies(tmp_path)


@pytest.mark.parametrize(
    "seed, kills", [(7, 3), *[pytest.param(s, 8, marks=pytest.mark.campaign) for s in range(4)]]
)
@pytest.mark.slow
def test_random_kills_during_delta_saves(tmp_path, python, child_env, seed, kills):
    rng = random.Random(seed)
    for _ in range(kills):
        run(python, child_env, tmp_path, rng.uniform(0.3, 1.2))
        every_version_verifies(tmp_path)
    assert CheckpointDir(tmp_path).committed_versions()
