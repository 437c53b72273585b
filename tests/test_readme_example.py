"""The README's training script, run verbatim: it trains, checkpoints, and after several
``kill -9`` resumes to a final state bit-identical to a run that was never interrupted."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import time
from pathlib import Path

import torch

from pcframe.restore.reader import load_version
from pcframe.store.directory import CheckpointDir

README = Path(__file__).resolve().parents[1] / "README.md"
STEPS = 1000  # long enough that every kill lands mid-run on a fast machine
FOLDER = "ckpts-loop"  # the script's checkpoint folder (each README example has its own)


def readme_script(directory: Path) -> Path:
    text = README.read_text()
    section = text[text.index("## Use it in a plain PyTorch loop") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README lost its example"
    script = directory / "train.py"
    script.write_text(match.group(1))
    return script


def run(python, env, workdir: Path, steps: int) -> subprocess.Popen:
    script = readme_script(workdir)
    return subprocess.Popen([python, str(script), str(steps)], cwd=workdir, env=env)


def newest(workdir: Path) -> int:
    return max(CheckpointDir(workdir / FOLDER).committed_versions(), default=0)


def final_state(workdir: Path) -> dict[str, torch.Tensor]:
    directory = CheckpointDir(workdir / FOLDER)
    loaded = load_version(directory.path(directory.committed_versions()[-1]))
    return {"step": loaded.manifest.step, **loaded.named_tensors()}


def test_the_readme_script_resumes_bit_identical_after_sigkills(tmp_path, python, child_env):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    killed.mkdir()
    assert run(python, child_env, reference, STEPS).wait(timeout=300) == 0
    expected = final_state(reference)
    assert expected["step"] == STEPS  # save_last: the final step is saved

    rng, kills = random.Random(11), 0
    while True:
        proc = run(python, child_env, killed, STEPS)
        if kills == 3:
            assert proc.wait(timeout=300) == 0
            break
        before = newest(killed)
        deadline = time.monotonic() + 120
        while newest(killed) <= before:  # kill only after one more checkpoint committed
            assert proc.poll() is None, "finished before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint committed"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.02))  # somewhere between two checkpoints
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        kills += 1
    got = final_state(killed)
    assert got["step"] == STEPS
    # The script seeds torch only: numpy's and Python's generators start from the OS's entropy
    # in each fresh process, so the two runs' (unused) states differ from the start.
    compared = [k for k in expected if k != "step" and not k.startswith(("rng/numpy", "rng/py"))]
    assert any(k.startswith("model/") for k in compared) and any("rng/torch" in k for k in compared)
    different = [k for k in compared if not torch.equal(expected[k], got[k])]
    assert not different, f"differ after resume: {different}"
    # A second run of a finished job restores the final step and trains no further.
    assert run(python, child_env, killed, STEPS).wait(timeout=300) == 0
    assert final_state(killed)["step"] == STEPS
