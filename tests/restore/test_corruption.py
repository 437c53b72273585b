"""Flipped bytes in the newest version are detected; restore falls back and says which/why."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

import pcframe
from pcframe import Checkpointer, NoValidCheckpoint
from pcframe.store.directory import CheckpointDir
from tests.helpers import flip_byte, small_training, state_equal, train_steps
from tests.save.test_disk_errors import Unwritable


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


def test_a_data_file_longer_than_its_manifest_says_is_named_as_such(tmp_path):
    """Bytes appended to a data file (a second writer, a copy tool gone wrong) are damage
    too; the reason used to call the longer file truncated."""
    two_versions(tmp_path)
    newest = CheckpointDir(tmp_path).committed_versions()[-1]
    with open(tmp_path / f"v{newest:08d}" / "data.bin", "ab") as f:
        f.write(b"\0" * 10)
    model, optimizer, _ = small_training()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() == 2
        reason = ckpt.last_restore.skipped[0][1]
    assert "10 bytes more than the manifest says" in reason
    assert "truncated" not in reason


def test_a_damaged_version_asked_for_is_named_and_the_others_are_left(tmp_path):
    """restore(version=N) / load(version=N) of a damaged N said "no valid checkpoint in"
    the folder, with no fix, while the other versions were valid."""
    two_versions(tmp_path)
    flip_byte(tmp_path / "v00000001" / "data.bin", 100)
    message = r"version 1 in .* is damaged \(.*checksum mismatch.*\): ask for another version"
    model, optimizer, _ = small_training(seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NoValidCheckpoint, match=message):
        pcframe.load(tmp_path, model=model, optimizer=optimizer, version=1)  # reads only
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        with pytest.raises(NoValidCheckpoint, match=message):
            ckpt.restore(version=1)
        assert state_equal(model.state_dict(), before)
        assert ckpt.committed_versions() == [2]  # the damaged one set aside, the other kept
        assert ckpt.restore() == 4


def test_a_damaged_version_that_cannot_be_set_aside_is_named_with_the_fix(tmp_path, caplog):
    """Setting a damaged version aside is a rename, which an unwritable folder refuses: it
    was dropped without a word, the version stayed listed (read and skipped at each restore,
    counted among the keep_last versions, so a good older one was pruned in its place)."""
    two_versions(tmp_path)
    flip_byte(tmp_path / "v00000002" / "data.bin", 100)
    model, optimizer, _ = small_training()
    with (
        caplog.at_level(logging.WARNING, logger="pcframe"),
        Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt,
        Unwritable(tmp_path),
    ):
        assert ckpt.restore() == 2
    assert "could not set damaged checkpoint version 2 aside" in caplog.text
    assert f"move {tmp_path / 'v00000002'} out of {tmp_path}" in caplog.text
    assert CheckpointDir(tmp_path).committed_versions() == [1, 2]


def test_a_damaged_version_left_listed_never_takes_a_good_ones_place(tmp_path, monkeypatch):
    """The damaged newest version could not be set aside (the rename refused), so it stayed
    listed and counted among the keep_last versions: the next save pruned the good version
    the restore had just loaded, leaving one restorable version where keep_last asked for
    two. Retention counts the good versions only, and leaves the damaged one in place."""
    two_versions(tmp_path)
    flip_byte(tmp_path / "v00000002" / "data.bin", 100)
    rename = os.rename

    def refuse_set_aside(source, target, *args, **kwargs):
        if os.path.basename(target).startswith(".corrupt-"):
            raise PermissionError(13, "Permission denied", str(target))
        return rename(source, target, *args, **kwargs)

    model, optimizer, _ = small_training()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, keep_last=2) as ckpt:
        with monkeypatch.context() as patch:
            patch.setattr(os, "rename", refuse_set_aside)
            assert ckpt.restore() == 2  # v1's step; v2 failed and could not be set aside
        ckpt.save(step=3).wait()  # v3
        assert ckpt.committed_versions() == [1, 2, 3]  # v1 is one of the two good ones
        ckpt.save(step=4).wait()  # v4: v1 goes, the damaged v2 is never counted
        assert ckpt.committed_versions() == [2, 3, 4]
    for version in (3, 4):
        pcframe.load(tmp_path, model=model, optimizer=optimizer, version=version)


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


@pytest.mark.parametrize("planted", ["symlink", "hardlink", "fifo"])
def test_setting_a_damaged_version_aside_writes_through_nothing_planted_in_it(tmp_path, planted):
    """The reason was written with write_text(): through a link planted as set-aside.txt in
    the damaged version (a file outside the folder overwritten), and into a FIFO for ever."""
    root, outside = tmp_path / "ckpt", tmp_path / "victim.txt"
    first = two_versions(root)
    outside.write_text("the user's file")
    damaged = root / "v00000002"
    flip_byte(damaged / "data.bin", 100)
    name = damaged / "set-aside.txt"
    if planted == "symlink":
        name.symlink_to(outside)
    elif planted == "hardlink":
        os.link(outside, name)
    else:
        os.mkfifo(name)
    model, optimizer, _ = small_training(seed=3)
    with Checkpointer(root, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() == 2  # returns: the FIFO hung it here
    assert state_equal(model.state_dict(), first)
    assert outside.read_text() == "the user's file"
    (aside,) = root.glob(".corrupt-v00000002-*")
    assert "checksum" in (aside / "set-aside.txt").read_text()


def test_a_writer_removes_only_its_own_leftovers_and_a_stray_name_takes_no_version(tmp_path):
    """Opening a Checkpointer deleted every *.tmp and .trash-* entry of the folder (the
    user's notes.tmp, a cache.tmp folder); a stray file named like the next version made
    its save fail with a raw NotADirectoryError; a non-canonical v000000001 was listed as
    version 1 and read and deleted through v00000001."""
    (tmp_path / "cache.tmp").mkdir()
    for name in ("notes.tmp", "cache.tmp/x", ".trash-me", "v00000002"):
        (tmp_path / name).write_text("user")
    for name in ("v00000007.tmp", ".trash-v00000005", ".fetch-v00000003-remote.tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / "LATEST.tmp").write_text("v00000004\n")
    (tmp_path / "v000000001").mkdir()
    model = torch.nn.Linear(3, 3)
    with Checkpointer(tmp_path, model=model) as ckpt:
        handle = ckpt.save(step=1)
        handle.wait()
        assert handle.version == 3  # v00000002 is a file: 2 is taken
    kept = {p.name for p in tmp_path.iterdir()}
    assert {"notes.tmp", "cache.tmp", ".trash-me", "v00000002", "v000000001"} <= kept
    assert (tmp_path / "cache.tmp" / "x").read_text() == "user"
    assert not kept & {
        "v00000007.tmp",
        ".trash-v00000005",
        ".fetch-v00000003-remote.tmp",
        "LATEST.tmp",
    }
    assert CheckpointDir(tmp_path).committed_versions() == [3]
