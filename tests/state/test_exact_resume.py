"""Train straight through vs. train, SIGKILL at a random step, resume: bit-identical results."""

from __future__ import annotations

import random
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load_file

STEPS = 90  # crosses an epoch boundary of the small workload (64 steps per epoch)
WORKLOAD = '{"hidden": 64, "layers": 2, "samples": 4096}'


def run_child(python, env, directory, final=None, kill_after=None):
    cmd = [
        python,
        "-m",
        "pcframe.apps.training",
        "--directory",
        str(directory),
        "--steps",
        str(STEPS),
        "--every",
        "7",
        "--workload-args",
        WORKLOAD,
        "--engine-args",
        '{"chunk_bytes": 8192}',
    ]
    if final:
        cmd += ["--final", str(final)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    last = 0
    for line in proc.stdout:
        if line.startswith("step "):
            last = int(line.split()[1])
            if kill_after is not None and last >= kill_after:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=120)
    if kill_after is None:
        assert proc.returncode == 0
    else:
        assert proc.returncode == -signal.SIGKILL
    return last


@pytest.mark.slow
def test_sigkill_and_resume_is_bit_identical(tmp_path, python, child_env):
    run_child(python, child_env, tmp_path / "straight", final=tmp_path / "straight.st")
    rng = random.Random()
    kills = sorted(rng.sample(range(5, STEPS - 5), 2))
    resumed = tmp_path / "resumed"
    for kill_at in kills:
        run_child(python, child_env, resumed, kill_after=kill_at)
    run_child(python, child_env, resumed, final=tmp_path / "resumed.st")
    straight = load_file(tmp_path / "straight.st")
    again = load_file(tmp_path / "resumed.st")
    assert straight.keys() == again.keys() and len(straight) > 10
    assert any(k.startswith("optimizer/") and k.endswith("exp_avg_sq") for k in straight)
    mismatched = [k for k in straight if not torch.equal(straight[k], again[k])]
    assert not mismatched, f"killed at steps {kills}; differing tensors: {mismatched[:5]}"
