"""PcframeCheckpoint with a real Lightning Trainer (a small module, CPU, resumable data)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pcframe.store.directory import CheckpointDir
from tests.integrations.killing import (
    final_version,
    kill_and_resume,
    newest,
    tensor_differences,
    tree_differences,
)

pytest.importorskip("lightning")

from pcframe.integrations.lightning import PcframeCheckpoint
from pcframe.policies import FixedSteps, Young

CHILD = Path(__file__).with_name("train_child_lightning.py")
STEPS = 30  # 5 batches an epoch: kills land in different epochs, mid-epoch and at its end


def start(python, env, directory: Path, steps: int = STEPS, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [python, str(CHILD), str(directory), str(steps), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return out


def assert_same_run(reference: Path, other: Path) -> None:
    step_a, tensors_a, tree_a = final_version(reference)
    step_b, tensors_b, tree_b = final_version(other)
    assert step_a == step_b == STEPS
    assert any(k.startswith("model/") for k in tensors_a)
    assert any(k.startswith("optimizer/") for k in tensors_a)
    # weights, AdamW moments, every RNG, the loader's generator
    assert not tensor_differences(tensors_a, tensors_b)
    assert not tree_differences(tree_a["scheduler"], tree_b["scheduler"])
    # Lightning's fit loop (progress counters, data position), callbacks, global step, epoch
    assert not tree_differences(tree_a["stateful"], tree_b["stateful"])


def sigkill_campaign(tmp_path: Path, python: str, env: dict, kills: int, seed: int) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    finish(start(python, env, reference, STEPS, "--delay", "0"))
    landed = kill_and_resume(lambda: start(python, env, killed), killed, kills=kills, seed=seed)
    assert landed >= min(kills, 2), f"only {landed} kills landed"
    assert_same_run(reference, killed)


def test_sigkilled_fit_resumes_bit_identical(tmp_path, python, child_env):
    sigkill_campaign(tmp_path, python, child_env, kills=2, seed=7)


@pytest.mark.campaign
@pytest.mark.parametrize("seed", range(4))
def test_sigkill_campaign(tmp_path, python, child_env, seed):
    sigkill_campaign(tmp_path, python, child_env, kills=6, seed=100 + seed)


# With the campaigns: the fallback itself is the engine's (tests/faults), and the SIGKILL
# test above restores through this callback in the default run.
@pytest.mark.campaign
def test_corrupt_newest_version_falls_back(tmp_path, python, child_env):
    run = tmp_path / "run"
    # Stop at step 20 (versions 3, 6, ..., 18 by the policy, 20 as the last step of that fit).
    out = finish(start(python, child_env, run, 20, "--delay", "0"))
    assert "resumed_step None" in out  # nothing there yet: a fresh start
    store = CheckpointDir(run)
    newest_version = store.committed_versions()[-1]
    data = store.path(newest_version) / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte: the chunk checksum fails
    data.write_bytes(bytes(raw))
    out = finish(start(python, child_env, run, STEPS, "--delay", "0"))
    assert "resumed_step 18 " in out, out[-2000:]  # the previous valid version
    assert "global_step 30" in out
    assert any(p.name.startswith(".corrupt-") for p in run.iterdir())  # quarantined
    assert final_version(run)[0] == STEPS


def test_policy_arguments(tmp_path):
    policy = Young()
    assert PcframeCheckpoint(tmp_path, policy=policy).policy is policy
    assert isinstance(PcframeCheckpoint(tmp_path, policy="young").policy, Young)
    fixed = PcframeCheckpoint(tmp_path, policy="fixed_steps", policy_options={"every": 7}).policy
    assert isinstance(fixed, FixedSteps) and fixed.every == 7
    assert PcframeCheckpoint(tmp_path, every_n_train_steps=5).policy.every == 5
    with pytest.raises(ValueError, match="no policy named 'nope'"):
        PcframeCheckpoint(tmp_path, policy="nope")
    with pytest.raises(ValueError, match="not both"):
        PcframeCheckpoint(tmp_path, policy=policy, every_n_train_steps=5)
    with pytest.raises(TypeError, match="interval policy or its name"):
        PcframeCheckpoint(tmp_path, policy=5)
    with pytest.raises(ValueError, match="save_top_k"):
        PcframeCheckpoint(tmp_path, monitor="val_loss", save_top_k=3)
    with pytest.raises(ValueError, match="resume="):
        PcframeCheckpoint(tmp_path, resume="newest")
    for bad in (-1, 1.5, True):  # the message named FixedSteps' `every`, not this argument
        with pytest.raises(ValueError, match=rf"every_n_train_steps={bad!r}: a whole number"):
            PcframeCheckpoint(tmp_path, every_n_train_steps=bad)


def test_import_error_names_the_extra(python, child_env):
    code = (
        "import sys; sys.modules['lightning'] = None; sys.modules['lightning.pytorch'] = None\n"
        "import pcframe.integrations.lightning"
    )
    proc = subprocess.run([python, "-c", code], env=child_env, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "ImportError: pcframe.integrations.lightning needs lightning: "
        "pip install 'pcframe[lightning]'"
    )


@pytest.mark.slow
def test_example_runs_and_resumes(tmp_path, python, child_env):
    example = Path(__file__).parents[2] / "examples" / "integrations" / "lightning_example.py"
    proc = subprocess.run(
        [python, str(example)], cwd=tmp_path, env=child_env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "trained to step 50" in proc.stdout and "resumed" not in proc.stdout
    assert newest(tmp_path / "ckpts-lightning") == 5  # steps 10, 20, ..., 50


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
