"""Hostile or damaged checkpoint directories: bounded hints, regular files only, no links.

LATEST is a hint: garbage, a device, a FIFO or a huge number in it is ignored with a warning
and the listing decides. Every file read from a version must be a regular file (a FIFO
named manifest.json must not hang anything); symbolic links are refused, and nothing
outside the directory is ever written or truncated. Version numbers above the limit never
become the base of new version numbers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pcframe import Checkpointer, CheckpointError
from pcframe.format.names import MAX_VERSION
from pcframe.store.directory import CheckpointDir

CLI = [sys.executable, "-m", "pcframe.apps.cli"]


def committed(root, steps=(1, 2)) -> torch.nn.Module:
    model = torch.nn.Linear(3, 3)
    with Checkpointer(root, model=model) as ckpt:
        for step in steps:
            with torch.no_grad():
                model.weight.fill_(step)
            ckpt.save(step).wait()
    return model


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    # A hang here is for ever (a FIFO read): the bound only has to outlast a CLI process's
    # start, 9-13 s (interpreter, torch) beside two busy loops, where 30 s had been given.
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize(
    "latest",
    [b"v0000\xff0002\n", b"\x00" * 64, b"v99999999999999999999\n", b"garbage", b""],
    ids=["flipped-bit", "zeros", "huge", "garbage", "empty"],
)
@pytest.mark.slow
def test_garbage_latest_is_ignored(tmp_path, caplog, latest):
    committed(tmp_path)
    (tmp_path / "LATEST").write_bytes(latest)
    assert CheckpointDir(tmp_path).latest_hint() is None
    with Checkpointer(tmp_path, model=torch.nn.Linear(3, 3)) as ckpt:
        assert ckpt.restore() == 2
        assert ckpt.save(3).version == 3  # numbered from the listing, not from LATEST
    if latest.strip():
        assert "ignoring" in caplog.text
    assert cli("list", tmp_path).returncode == 0


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "directory", "symlink"])
def test_latest_that_is_not_a_regular_file(tmp_path, kind):
    committed(tmp_path)
    latest = tmp_path / "LATEST"
    latest.unlink()
    if kind == "dev-zero":
        latest.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(latest)
    elif kind == "directory":
        latest.mkdir()
    else:
        (tmp_path / "elsewhere").write_text("v00000099\n")
        latest.symlink_to(tmp_path / "elsewhere")
    assert CheckpointDir(tmp_path).latest_hint() is None  # returns at once, reads nothing
    result = cli("list", tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr


def test_huge_version_directories_never_number_new_versions(tmp_path, caplog):
    committed(tmp_path)
    (tmp_path / ("v" + "9" * 20)).mkdir()
    (tmp_path / f"v{MAX_VERSION + 1}").mkdir()
    (tmp_path / "LATEST").write_text(f"v{MAX_VERSION + 5}\n")
    assert CheckpointDir(tmp_path).committed_versions() == [1, 2]
    # (take_over: it saves beside versions 1-2 before restoring)
    with Checkpointer(tmp_path, model=torch.nn.Linear(3, 3), take_over=True) as ckpt:
        handle = ckpt.save(3)
        assert handle.version == 3 and handle.wait() == "committed"
        assert ckpt.restore() == 3
    assert "above the limit" in caplog.text


@pytest.mark.slow
def test_fifo_manifest_is_corruption_not_a_hang(tmp_path):
    committed(tmp_path)
    manifest = tmp_path / "v00000002" / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    for command in (["list"], ["verify"], ["inspect"], ["export", "--out", tmp_path / "x.st"]):
        result = cli(*command[:1], tmp_path, *command[1:])
        assert "Traceback" not in result.stderr, result.stderr
    assert cli("verify", tmp_path).returncode != 0
    with Checkpointer(tmp_path, model=torch.nn.Linear(3, 3)) as ckpt:
        assert ckpt.restore() == 1  # falls back
        assert "not a regular file" in ckpt.last_restore.skipped[0][1]


@pytest.mark.parametrize("name", ["data.bin", "manifest.json"])
def test_symlinked_file_inside_a_version_is_refused(tmp_path, name):
    committed(tmp_path)
    target = tmp_path / "v00000002" / name
    outside = tmp_path.parent / f"outside-{name}"
    outside.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(outside)
    with Checkpointer(tmp_path, model=torch.nn.Linear(3, 3)) as ckpt:
        assert ckpt.restore() == 1
        assert "symbolic link" in ckpt.last_restore.skipped[0][1]


def test_symlinked_version_directory_is_not_listed(tmp_path, caplog):
    committed(tmp_path, steps=(1,))
    elsewhere = tmp_path.parent / "elsewhere"
    committed(elsewhere, steps=(1, 2, 3, 4))
    (tmp_path / "v00000004").symlink_to(elsewhere / "v00000004")
    assert CheckpointDir(tmp_path).committed_versions() == [1]
    with Checkpointer(tmp_path, model=torch.nn.Linear(3, 3), keep_last=1) as ckpt:
        assert ckpt.restore() == 1
        ckpt.save(2).wait()
    assert (elsewhere / "v00000004").is_dir()  # nothing deleted through the link
    assert "symbolic link" in caplog.text


def test_symlinked_lock_is_refused_and_its_target_untouched(tmp_path):
    outside = tmp_path.parent / f"{tmp_path.name}-precious"
    outside.write_text("precious\n")
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / ".writer.lock").symlink_to(outside)
    with pytest.raises(CheckpointError, match="symbolic link"):
        Checkpointer(tmp_path, model=torch.nn.Linear(3, 3))
    assert outside.read_text() == "precious\n"


@pytest.mark.parametrize("name", ["LATEST.tmp", ".clean-exit.tmp"])
def test_planted_temporary_links_are_never_written_through(tmp_path, name):
    outside = tmp_path.parent / f"{tmp_path.name}-{name}-precious"
    outside.write_text("precious\n")
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / name).symlink_to(outside)
    with Checkpointer(tmp_path, model=torch.nn.Linear(3, 3)) as ckpt:
        ckpt.save(1).wait()
    assert outside.read_text() == "precious\n"
    assert CheckpointDir(tmp_path).latest_hint() == 1
