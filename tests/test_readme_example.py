"""The README's plain-PyTorch example runs as printed, and a second run resumes from it."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from pcframe import ResumableLoader, ResumableSampler
from pcframe.store.directory import CheckpointDir

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("## Use it in a plain PyTorch loop") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README lost its example"
    return match.group(1)


def names(total: int) -> dict:
    """The objects the example assumes the user already has."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    dataset = TensorDataset(torch.randn(64, 8))
    sampler = ResumableSampler(len(dataset), seed=0)
    loader = ResumableLoader(DataLoader(dataset, batch_size=8, sampler=sampler))
    batches = (batch for _ in range(total) for (batch,) in loader)
    return {"model": model, "opt": opt, "sched": sched, "loader": loader, "total": total,
            "batches": batches}  # fmt: skip


def test_the_readme_example_trains_checkpoints_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example writes to ./ckpts
    code = compile(readme_example(), str(README), "exec")
    first = names(total=20)
    exec(code, first)
    versions = CheckpointDir(tmp_path / "ckpts").committed_versions()
    assert versions, "the example saved nothing"
    assert first["start"] == 0
    # Run it again for longer: it restores the newest version (step 20) and goes on.
    second = names(total=30)
    exec(code, second)
    assert second["start"] == 20
    assert CheckpointDir(tmp_path / "ckpts").committed_versions()[-1] > versions[-1]
