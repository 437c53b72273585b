"""A real training process gets SIGTERM (a spot preemption notice) in the middle of a run.

With ``NoticeDriven`` it takes an emergency checkpoint at the current step, waits until it is
durable and exits cleanly: the resumed run loses at most one step. Without it, SIGTERM kills
the process and the resumed run loses everything since the last periodic checkpoint. With a
memory tier in front of a disk tier, the emergency version goes to the disk (memory does not
outlive the VM), so the resume works even after the memory tier is wiped.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from pcframe.restore.reader import load_version
from pcframe.store.directory import CheckpointDir

CHILD = r"""
import os, sys, time, torch
import pcframe.policies as P
from pcframe import Checkpointer


from tests.stamp import StepStampOptimizer

directory, mode, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
hold_at = int(os.environ.get("HOLD_AT", "0"))  # durable there, then wait for the signal
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
opt = StepStampOptimizer(model.parameters())
kwargs = {}
if mode == "periodic":
    policy = P.FixedSteps(20)
else:
    # a periodic policy that would not save for a long time, plus SIGTERM as the notice
    policy = P.NoticeDriven(
        P.FixedSteps(1000), P.SignalNoticeSource(["SIGTERM"], window=30.0),
        save_time_prior=1.0, margin=2.0,
    )
if mode == "notice-tiers":
    kwargs = dict(
        tiers={"local": sys.argv[4]},
        placement=P.MemoryThenDisk(memory_keep=1, disk_keep=2, disk_every=1000),
    )
with Checkpointer(directory, model=model, optimizer=opt, policy=policy, **kwargs) as ckpt:
    step = ckpt.restore() or 0
    opt.count = step
    print("restored", step, flush=True)
    while step < stop_at:
        step += 1
        opt.step()
        time.sleep(0.01)  # the rest of an iteration
        ckpt.maybe_save(step)
        if step == hold_at:
            ckpt.wait()
        print("step", step, flush=True)
        if step == hold_at:
            time.sleep(120)
        if ckpt.last_decision is not None and ckpt.last_decision.emergency:
            secured = ckpt.last_secured
            print("emergency", step, secured.tiers if secured else "", flush=True)
            break
"""

SIGNAL_AT = 35  # steps; the periodic policy saved at 20 by then


def run(python, env, directory, mode, stop_at, disk=None, signal_at=None):
    """Run the child; SIGTERM it once it reports ``signal_at``. Returns (rc, lines, signalled)."""
    cmd = [python, "-c", CHILD, str(directory), mode, str(stop_at)] + ([str(disk)] if disk else [])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, signalled = [], None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            words = line.split()
            lines.append(words)
            due = signal_at is not None and signalled is None and words[0] == "step"
            if due and int(words[1]) >= signal_at:
                signalled = int(words[1])
                proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
        stderr = proc.stderr.read() if proc.stderr else ""
    assert rc in (0, -signal.SIGTERM), stderr
    return rc, lines, signalled


def restored_and_last(lines):
    restored = next(int(words[1]) for words in lines if words[0] == "restored")
    steps = [int(words[1]) for words in lines if words[0] == "step"]
    return restored, (steps[-1] if steps else restored)


@pytest.mark.slow
def test_sigterm_emergency_checkpoint_loses_at_most_one_step(tmp_path, python, child_env):
    directory = tmp_path / "ckpt"
    rc, lines, signalled = run(python, child_env, directory, "notice", 10_000, signal_at=SIGNAL_AT)
    assert rc == 0  # SIGTERM became a notice, not a kill; the process finished its save
    _, last = restored_and_last(lines)
    assert lines[-1][:2] == ["emergency", str(last)]
    assert last >= signalled  # saved at (or just after) the step the signal arrived
    versions = CheckpointDir(directory).committed_versions()
    assert len(versions) == 1  # FixedSteps(1000) never saved: this is the emergency save
    loaded = load_version(directory / f"v{versions[0]:08d}")
    assert loaded.manifest.step == last
    assert "notice (SIGTERM)" in loaded.manifest.metadata["reason"]
    assert {float(t.flatten()[0]) for t in loaded.tensors if t.is_floating_point()} == {last}

    _, resumed, _ = run(python, child_env, directory, "notice", last + 3)
    restored, _ = restored_and_last(resumed)
    assert last - restored <= 1  # the promise: at most one step lost
    assert [int(w[1]) for w in resumed if w[0] == "step"] == [
        restored + 1,
        restored + 2,
        restored + 3,
    ]


@pytest.mark.slow
def test_without_a_notice_policy_sigterm_loses_the_periodic_interval(tmp_path, python, child_env):
    directory = tmp_path / "ckpt"
    # The child waits at the signal's step, its periodic version durable: read from its
    # pipe, the line of step 35 could reach a busy test process when the child had trained
    # (and saved at 40) past it, or before step 20's version was committed.
    env = dict(child_env, HOLD_AT=str(SIGNAL_AT))
    rc, lines, signalled = run(python, env, directory, "periodic", 10_000, signal_at=SIGNAL_AT)
    assert rc == -signal.SIGTERM  # killed at once
    _, last = restored_and_last(lines)
    assert last == signalled == SIGNAL_AT
    # what a resumed run restores: the newest committed version (it verifies)
    newest = CheckpointDir(directory).committed_versions()[-1]
    restored = load_version(directory / f"v{newest:08d}").manifest.step
    assert restored == SIGNAL_AT // 20 * 20  # the periodic save before the signal
    assert 1 < last - restored <= 20  # up to a whole interval lost


@pytest.mark.slow
def test_sigterm_with_a_memory_tier_secures_the_version_on_disk(tmp_path, python, child_env):
    shm = Path("/dev/shm") / f"pcframe-e2e-{uuid.uuid4().hex[:12]}"
    disk = tmp_path / "disk"
    try:
        rc, lines, signalled = run(
            python, child_env, shm, "notice-tiers", 10_000, disk=disk, signal_at=SIGNAL_AT
        )
        assert rc == 0
        _, last = restored_and_last(lines)
        assert lines[-1][0] == "emergency" and "local" in lines[-1][2]  # the disk tier
        assert (
            load_version(
                disk / f"v{CheckpointDir(disk).committed_versions()[-1]:08d}"
            ).manifest.step
            == last
        )
        shutil.rmtree(shm)  # the VM went away: nothing left in memory
        _, resumed, _ = run(python, child_env, shm, "notice-tiers", last + 1, disk=disk)
        restored, _ = restored_and_last(resumed)
        assert last - restored <= 1 and restored >= signalled
    finally:
        shutil.rmtree(shm, ignore_errors=True)
