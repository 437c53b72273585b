"""SIGKILL a process that saves in a loop, at random moments and (``pytest -m campaign``) at
every commit phase after a restore."""

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
model = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(6)])
opt = StepStampOptimizer(model.parameters())
with Checkpointer(sys.argv[1], model=model, optimizer=opt, chunk_bytes=8192,
                  max_in_flight=3, writer_threads=3, keep_last=2) as ckpt:
    step = ckpt.restore() or 0
    opt.count = step
    print("ready", step, flush=True)
    while True:
        step += 1
        opt.step()  # every parameter now holds the value `step`; gated on in-flight copies
        ckpt.save(step)
"""


def check_directory(root, previous_latest):
    """The directory recovers to a committed version that verifies; LATEST never went back."""
    directory = CheckpointDir(root)
    versions = directory.committed_versions()
    latest = directory.latest_hint()
    if latest is not None:
        assert latest >= previous_latest, f"LATEST went back from {previous_latest} to {latest}"
        assert latest in versions or latest < max(versions), "LATEST names a missing version"
    if versions:
        loaded = load_version(directory.path(versions[-1]))
        step = loaded.manifest.step
        values = {
            float(t.flatten()[0]) for t in loaded.tensors if t.numel() and t.is_floating_point()
        }
        model_values = {
            float(t.flatten()[0])
            for e, t in zip(loaded.manifest.entries, loaded.tensors, strict=True)
            if e.name.startswith("model/")
        }
        assert model_values == {float(step)}, f"version mixes steps: {sorted(values)[:5]}"
        assert max(versions) >= (latest or 0)
    return max(latest or 0, previous_latest), versions


def kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


def start(python, env, root):
    proc = subprocess.Popen(
        [python, "-c", SAVER, str(root)], env=env, stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    assert line.startswith("ready"), line
    return proc, int(line.split()[1])


@pytest.mark.parametrize("trials", [4, pytest.param(16, marks=pytest.mark.campaign)])
@pytest.mark.slow
def test_random_sigkills_always_recover(tmp_path, python, child_env, trials):
    rng = random.Random()
    latest, last_step = 0, 0
    for trial in range(trials):
        proc, step = start(python, child_env, tmp_path)
        assert step >= last_step, f"trial {trial}: resumed at step {step} < {last_step}"
        if trial == trials - 1:  # a loaded machine may let every kill land before a commit
            deadline = time.monotonic() + 60
            while not CheckpointDir(tmp_path).committed_versions() and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(rng.uniform(0.05, 0.6))
        kill(proc)
        latest, versions = check_directory(tmp_path, latest)
        last_step = step
    assert versions, "no version was ever committed"


# The default run kills at each of these points in tests/faults/test_crash_matrix.py (raw
# mode, with more checks: no version the child was told is committed is lost, no leftovers);
# this older variant, a crash after a restore by another process, runs with the campaigns.
@pytest.mark.campaign
@pytest.mark.parametrize(
    "point",
    [
        "chunk_written:3",
        "data_synced",
        "manifest_written",
        "published",
        "latest_written:2",
        "retention",
        "trash_renamed",
    ],
)
def test_sigkill_at_each_commit_phase(tmp_path, python, child_env, point):
    latest = 0
    proc, _ = start(python, child_env, tmp_path)  # make a few good versions first
    time.sleep(0.3)
    kill(proc)
    latest, before = check_directory(tmp_path, latest)
    assert before
    env = dict(child_env, PCFRAME_CRASH_AT=point)
    proc, step = start(python, env, tmp_path)
    assert proc.wait(timeout=60) == -signal.SIGKILL  # it crashed at the point, by itself
    proc.stdout.close()
    latest, after = check_directory(tmp_path, latest)
    assert after and max(after) >= max(before)
    # A fresh writer cleans up what the crash left behind and resumes from a good version.
    proc, resumed = start(python, child_env, tmp_path)
    kill(proc)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp") or "trash" in p.name]
    assert resumed >= step
    assert not leftovers or all(
        name.startswith(".trash") or name.endswith(".tmp") for name in leftovers
    )
