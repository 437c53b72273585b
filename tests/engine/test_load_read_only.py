"""pcframe.load() restores from a read-only checkpoint directory and writes nothing."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import pcframe
from pcframe import Checkpointer, NoValidCheckpoint
from tests.engine.helpers import small_training, state_equal, train_steps


def snapshot_tree(root) -> dict:
    return {p: (p.stat().st_mode, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def make_read_only(root) -> None:
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
        os.chmod(path, mode)


def test_load_from_a_read_only_directory(tmp_path):
    model, optimizer, scheduler = small_training()
    with Checkpointer(tmp_path / "ro", model=model, optimizer=optimizer, scheduler=scheduler) as c:
        for step in (1, 2):
            train_steps(model, optimizer, scheduler, 1, seed=step)
            c.save(step).wait()
            if step == 1:
                after_step_1 = {k: v.clone() for k, v in model.state_dict().items()}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    root = tmp_path / "ro"
    # Corrupt the newest version: load falls back, but renames nothing (it cannot write).
    data = root / "v00000002" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(raw)
    make_read_only(root)
    before = snapshot_tree(root)
    model2, optimizer2, scheduler2 = small_training(seed=5)
    report = pcframe.load(root, model=model2, optimizer=optimizer2, scheduler=scheduler2)
    assert report.step == 1 and report.skipped and report.skipped[0][0] == 2
    assert snapshot_tree(root) == before  # nothing created, renamed, locked or changed
    assert state_equal(model2.state_dict(), after_step_1)  # version 1, not the corrupt 2
    assert not state_equal(model2.state_dict(), expected)
    os.chmod(root, 0o755)


def test_load_reports_no_checkpoint_and_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    assert pcframe.load(tmp_path / "empty", model=torch.nn.Linear(2, 2)).step is None
    with pytest.raises(pcframe.CheckpointError, match="not a directory"):
        pcframe.load(tmp_path / "missing", model=torch.nn.Linear(2, 2))
    with Checkpointer(tmp_path / "one", model=torch.nn.Linear(2, 2)) as c:
        c.save(1).wait()
    (tmp_path / "one" / "v00000001" / "manifest.json").write_text("garbage")
    with pytest.raises(NoValidCheckpoint):
        pcframe.load(tmp_path / "one", model=torch.nn.Linear(2, 2))
