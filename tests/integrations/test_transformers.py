"""PcframeCallback with a real transformers.Trainer (tiny GPT-2 from a config, CPU)."""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from pcframe.restore.reader import load_version
from pcframe.store.directory import CheckpointDir
from tests.integrations.killing import (
    final_version,
    kill_and_resume,
    newest,
    tensor_differences,
    tree_differences,
)

pytest.importorskip("transformers")

from tests.integrations.test_transformers_eval import StopAfter
from tests.integrations.test_transformers_restore import trainer_for

CHILD = Path(__file__).with_name("train_child_hf.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def child_env(child_env: dict[str, str]) -> dict[str, str]:
    """The children here import only pcframe (installed), so the repository stays off their
    path: its top-level ``kernels/`` folder (pcframe.kernels) would shadow Hugging Face's
    ``kernels`` package, which transformers >= 5.25 imports when it is installed."""
    entries = child_env.get("PYTHONPATH", "").split(os.pathsep)
    kept = [e for e in entries if e and Path(e).resolve() != REPO]
    child_env = dict(child_env)
    if kept:
        child_env["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        child_env.pop("PYTHONPATH", None)
    return child_env


STEPS = 30  # 10 batches an epoch: the kills land in different epochs and mid-epoch


def start(python, env, directory: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [python, str(CHILD), str(directory), str(STEPS), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_sigkilled_trainer_resumes_bit_identical(tmp_path, python, child_env):
    sigkill_campaign(tmp_path, python, child_env, kills=2, seed=16)


@pytest.mark.slow
def test_sigkilled_trainer_with_uneven_accumulation_resumes_bit_identical(
    tmp_path, python, child_env
):
    # 10 batches an epoch in windows of 3, 3, 3 and 1 (4 steps an epoch): most versions (every
    # 3 steps) are mid-epoch, some just before the epoch's last, shorter window.
    accumulate = ("--accumulate", "3")
    sigkill_campaign(tmp_path, python, child_env, kills=2, seed=16, extra=accumulate)


@pytest.mark.campaign
@pytest.mark.parametrize("seed", range(4))
def test_sigkill_campaign(tmp_path, python, child_env, seed):
    sigkill_campaign(tmp_path, python, child_env, kills=6, seed=200 + seed)


def sigkill_campaign(
    tmp_path: Path, python: str, env: dict, kills: int, seed: int, extra: tuple[str, ...] = ()
) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    finish(start(python, env, reference, "--delay", "0", *extra))
    landed = kill_and_resume(
        lambda: start(python, env, killed, *extra), killed, kills=kills, seed=seed
    )
    assert landed >= min(kills, 2), f"only {landed} kills landed"
    step_a, tensors_a, tree_a = final_version(reference)
    step_b, tensors_b, tree_b = final_version(killed)
    assert step_a == step_b == STEPS
    assert any(k.startswith("model/") for k in tensors_a)
    assert any(k.startswith("optimizer/") for k in tensors_a)
    assert not tensor_differences(tensors_a, tensors_b)  # weights, Adam moments, RNGs
    assert not tree_differences(tree_a["scheduler"], tree_b["scheduler"])
    # TrainerState: global_step, epoch (a float, bit for bit), tokens seen, ... (total_flos
    # lags by the steps since the last log: docs/integrations.md, Limits)
    assert not tree_differences(tree_a["stateful"], tree_b["stateful"])


def test_import_error_names_the_extra(python, child_env):
    code = (
        "import sys; sys.modules['transformers'] = None\nimport pcframe.integrations.transformers"
    )
    proc = subprocess.run([python, "-c", code], env=child_env, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "ImportError: pcframe.integrations.transformers needs transformers: "
        "pip install 'pcframe[transformers]'"
    )


@pytest.mark.slow
def test_example_runs(tmp_path, python, child_env):
    example = Path(__file__).parents[2] / "examples" / "integrations" / "hf_example.py"
    proc = subprocess.run(
        [python, str(example)], cwd=tmp_path, env=child_env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "trained to step 40" in proc.stdout and "resumed" not in proc.stdout  # fresh start
    versions = newest(tmp_path / "ckpts-hf")
    assert versions == 4  # save_steps=10
    # A finished run started again resumes its last step and trains no further.
    again = subprocess.run(
        [python, str(example)], cwd=tmp_path, env=child_env, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resumed from step 40" in again.stdout and "trained to step 40" in again.stdout
    assert newest(tmp_path / "ckpts-hf") == versions  # nothing trained, nothing saved


def test_policy_by_name_and_object(tmp_path):
    from pcframe.integrations.transformers import PcframeCallback
    from pcframe.policies import FixedSteps, Young

    policy = Young()
    assert PcframeCallback(tmp_path, policy=policy).policy is policy
    assert isinstance(PcframeCallback(tmp_path, policy="young").policy, Young)
    assert PcframeCallback(tmp_path, save_steps=4).policy.every == 4
    with pytest.raises(ValueError, match="not both"):
        PcframeCallback(tmp_path, policy=FixedSteps(3), save_steps=4)


# With the campaigns: the fallback itself is the engine's (tests/faults), and the SIGKILL
# test restores through this callback in the default run.
@pytest.mark.campaign
def test_corrupt_newest_version_falls_back(tmp_path, python, child_env):
    run = tmp_path / "run"
    # The policy by name: FixedSteps() saves every 10 steps.
    out = finish(start(python, child_env, run, "--delay", "0", "--policy", "fixed_steps"))
    assert "resumed_step None global_step 30" in out  # nothing there yet: a fresh start
    assert [final_step(run, v) for v in CheckpointDir(run).committed_versions()] == [10, 20, 30]
    store = CheckpointDir(run)
    data = store.path(store.committed_versions()[-1]) / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01  # one flipped bit: the chunk checksum fails
    data.write_bytes(bytes(raw))
    out = finish(start(python, child_env, run, "--delay", "0", "--policy", "fixed_steps"))
    assert "resumed_step 20 global_step 30" in out  # the previous valid version, then 21..30
    assert any(p.name.startswith(".corrupt-") for p in run.iterdir())


# gradient_accumulation_steps=3 and 7 batches an epoch: windows of 3, 3 and 1 batches (the
# last, shorter one ends the epoch), 3 optimizer steps an epoch.
UNEVEN = {"samples": 28, "gradient_accumulation_steps": 3}
UNEVEN_STEPS = 9  # 3 epochs


def uneven_trainer(directory: Path, *callbacks: object) -> tuple:
    """A Trainer of the restore tests (a version every 3 steps, and the last) on UNEVEN, and
    the batches it trains: optimizer step -> the samples of each batch accumulated into it."""
    trainer, callback = trainer_for(directory, UNEVEN_STEPS, callbacks=callbacks, **UNEVEN)
    windows: dict[int, list[list[list[int]]]] = {}

    def forward(module: object, args: object, kwargs: dict) -> None:
        step = trainer.state.global_step + 1  # the optimizer step this batch goes into
        windows.setdefault(step, []).append(kwargs["input_ids"].tolist())

    trainer.model.register_forward_pre_hook(forward, with_kwargs=True)
    return trainer, callback, windows


@pytest.fixture(scope="module")
def uneven_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """An uninterrupted run on UNEVEN: its folder, batches and final weights."""
    directory = tmp_path_factory.mktemp("uneven") / "reference"
    trainer, _, windows = uneven_trainer(directory)
    trainer.train()
    assert [len(windows[s]) for s in sorted(windows)] == [3, 3, 1] * 3
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return directory, windows, weights


# transformers' advice for a tiny CPU run (pin_memory, tokens) is not under test here.
@pytest.mark.filterwarnings("ignore::Warning")
@pytest.mark.parametrize(
    "stop",
    [
        5,  # mid-epoch 1, its last, shorter window still to train
        2,  # the next window is epoch 0's last, shorter one
        pytest.param(3, marks=pytest.mark.slow),  # after that window: the end of epoch 0
        pytest.param(4, marks=pytest.mark.slow),  # one step after the epoch boundary
    ],
)
def test_accumulation_not_dividing_the_epoch_resumes_bit_identical(
    tmp_path: Path, uneven_reference: tuple, stop: int
) -> None:
    reference, windows, weights = uneven_reference
    run = tmp_path / "run"
    first, _, before = uneven_trainer(run, StopAfter(stop))
    first.train()
    resumed, callback, after = uneven_trainer(run)  # a new Trainer, as after a SIGKILL
    resumed.train()
    assert callback.resumed_step == stop and resumed.state.global_step == UNEVEN_STEPS
    assert "_run_epoch" not in vars(resumed)  # the first epoch's wrapper is gone
    # Every optimizer step accumulated the batches, and only those, of the uninterrupted run.
    trained = {**before, **after}
    differ = [
        s for s in sorted(windows.keys() | trained.keys()) if trained.get(s) != windows.get(s)
    ]
    assert not differ, f"optimizer steps trained on other batches than uninterrupted: {differ}"
    now = resumed.model.state_dict()
    assert not [k for k in weights if not torch.equal(weights[k], now[k])]
    step_a, tensors_a, tree_a = final_version(reference)
    step_b, tensors_b, tree_b = final_version(run)
    assert step_a == step_b == UNEVEN_STEPS
    assert not tensor_differences(tensors_a, tensors_b)  # weights, Adam moments, RNGs
    assert not tree_differences(tree_a["scheduler"], tree_b["scheduler"])
    assert not tree_differences(tree_a["stateful"], tree_b["stateful"])  # epoch 3.0, ...


def test_a_resume_keeps_the_trainers_own_per_instance_run_epoch(
    tmp_path: Path, uneven_reference: tuple
) -> None:
    """A per-instance ``_run_epoch`` (a user's or a profiler's patch) set before ``train()``
    sees every epoch of a mid-epoch resume and stays installed after it (the first epoch's
    wrapper removed it: epochs 1 and 2 bypassed it), and the resume is still exact."""
    _, _, weights = uneven_reference
    run = tmp_path / "run"
    first, _, _ = uneven_trainer(run, StopAfter(5))
    first.train()
    resumed, _, _ = uneven_trainer(run)
    epochs: list[int] = []
    plain = type(resumed)._run_epoch

    @functools.wraps(plain)
    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        epochs.append(inspect.signature(plain).bind(self, *args, **kwargs).arguments["epoch"])
        return plain(self, *args, **kwargs)

    resumed._run_epoch = types.MethodType(patched, resumed)
    resumed.train()
    # Resumed in epoch 1 (step 5, 3 steps an epoch), then epoch 2: the Trainer, which believes
    # the run fresh, counts them from 0.
    assert epochs == [0, 1], epochs
    assert vars(resumed)["_run_epoch"].__func__ is patched
    now = resumed.model.state_dict()
    assert not [k for k in weights if not torch.equal(weights[k], now[k])]


def final_step(directory: Path, version: int) -> int:
    return load_version(CheckpointDir(directory).path(version)).manifest.step


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
