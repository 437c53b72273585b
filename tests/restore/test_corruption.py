"""Flipped bytes in the newest version are detected; restore falls back and says which/why."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

import pcframe
from pcframe import Checkpointer, NoValidCheckpoint
from pcframe.store.directory import CheckpointDir
from tests.helpers import flip_byte, small_training, state_equal, train_steps


def two_versions(root):
    model, optimizer, scheduler = small_training()
    with Checkpointer(root, model=model, optimizer=optimizer, chunk_bytes=4096) as ckpt:
        train_steps(model, optimizer, scheduler, 2)
        ckpt.save(step=2).wait()
        first = {k: v.clone() for k, v in model.state_dict().items()}
        train_steps(model, optimizer, scheduler, 2)
        ckpt.save(step=4).wait()
    return first


@pytest.mark.parametrize(
    ("filename", "offset"),
    [
        ("data.bin", 100),
        ("data.bin", -1),
        ("manifest.json", 150),
        ("manifest.json", -3),
        ("manifest.json", 10),
    ],
)
def test_flipped_byte_falls_back_to_previous(tmp_path, caplog, filename, offset):
    first = two_versions(tmp_path)
    newest = CheckpointDir(tmp_path).committed_versions()[-1]
    flip_byte(tmp_path / f"v{newest:08d}" / filename, offset)
    model, optimizer, _ = small_training(seed=3)
    with (
        caplog.at_level(logging.WARNING, logger="pcframe"),
        Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt,
    ):
        assert ckpt.restore() == 2
        report = ckpt.last_restore
    assert report.version == newest - 1
    assert [v for v, _ in report.skipped] == [newest]
    assert filename in report.skipped[0][1] or "manifest" in report.skipped[0][1]
    assert f"skipping checkpoint version {newest}" in caplog.text
    assert state_equal(model.state_dict(), first)
    # The bad version is moved aside, not deleted, and no longer listed.
    assert CheckpointDir(tmp_path).committed_versions() == [newest - 1]
    assert list(tmp_path.glob(f".corrupt-v{newest:08d}-*"))


def test_missing_data_file_falls_back(tmp_path):
    two_versions(tmp_path)
    newest = CheckpointDir(tmp_path).committed_versions()[-1]
    (tmp_path / f"v{newest:08d}" / "data.bin").unlink()
    model, optimizer, _ = small_training()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() == 2
        assert "missing" in ckpt.last_restore.skipped[0][1]


def test_truncated_data_file_falls_back(tmp_path):
    two_versions(tmp_path)
    newest = CheckpointDir(tmp_path).committed_versions()[-1]
    path = tmp_path / f"v{newest:08d}" / "data.bin"
    path.write_bytes(path.read_bytes()[:-10])
    model, optimizer, _ = small_training()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() == 2
        assert "truncated" in ckpt.last_restore.skipped[0][1]


def test_all_versions_corrupt_raises_and_keeps_model(tmp_path):
    two_versions(tmp_path)
    for version in CheckpointDir(tmp_path).committed_versions():
        flip_byte(tmp_path / f"v{version:08d}" / "data.bin", 64)
    model, optimizer, _ = small_training(seed=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with (
        Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt,
        pytest.raises(NoValidCheckpoint, match="checksum mismatch"),
    ):
        ckpt.restore()
    assert state_equal(model.state_dict(), before), "a failed restore must not touch the model"


def test_the_next_start_after_every_version_was_set_aside_does_not_begin_at_step_0(tmp_path):
    """The restore that quarantined every version raised; the job's next start found no
    committed version and returned None (an INFO line): training began again at step 0
    while the set-aside versions sat there, lost if the damage was a false alarm."""
    two_versions(tmp_path)
    for version in CheckpointDir(tmp_path).committed_versions():
        flip_byte(tmp_path / f"v{version:08d}" / "data.bin", 64)
    model, optimizer, _ = small_training(seed=8)
    with (
        Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt,
        pytest.raises(NoValidCheckpoint, match="checksum mismatch"),
    ):
        ckpt.restore()
    set_aside = sorted(p.name for p in tmp_path.glob(".corrupt-v*"))
    assert len(set_aside) == 2

    def restart():
        with Checkpointer(tmp_path, model=model, optimizer=optimizer) as again:
            return again.restore()

    for restore in (restart, lambda: pcframe.load(tmp_path, model=model, optimizer=optimizer)):
        with pytest.raises(NoValidCheckpoint, match="set aside as damaged") as caught:
            restore()
        assert all(name in str(caught.value) for name in set_aside)
    for name in set_aside:  # the user's decision: start over
        shutil.rmtree(tmp_path / name)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() is None


def test_empty_directory_restores_nothing(tmp_path):
    model, optimizer, _ = small_training()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() is None
        assert ckpt.last_restore.skipped == []
    assert torch.is_tensor(next(model.parameters()))
