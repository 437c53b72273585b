"""Full disk and read-only file systems: a clear error, the last version intact, training on."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from pcframe import Checkpointer, CheckpointError, SaveError
from pcframe.restore.reader import load_version
from pcframe.save.status import SaveStatus
from pcframe.store.directory import CheckpointDir


def _mount_tmpfs(path, size):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a size-limited tmpfs")
    path.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if result.returncode:
        pytest.skip(f"cannot mount tmpfs here: {result.stderr.decode().strip()}")


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "fs"
    _mount_tmpfs(mount, "1m")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


class Blob:
    def __init__(self, nbytes):
        self.tensor = torch.zeros(nbytes // 4)

    def state_dict(self):
        return {"t": self.tensor}

    def load_state_dict(self, state):
        self.tensor = state["t"]


def test_enospc_is_reported_and_previous_version_survives(small_fs):
    blob = Blob(440_000)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(
        small_fs,
        model=model,
        optimizer=optimizer,
        stateful={"blob": blob},
        keep_last=5,
        chunk_bytes=65536,
    ) as ckpt:
        ckpt.save(step=1).wait()
        ckpt.save(step=2).wait()
        ckpt.save(step=3)  # a third copy of ~440 KB does not fit in 1 MB
        with pytest.raises(SaveError) as info:
            ckpt.wait()
        message = str(info.value)
        assert "no space left on device" in message and "version 3" in message
        assert "stage 'persist'" in message and "intact" in message
        assert info.value.version == 3
        # Training goes on; the engine keeps working once space is freed.
        optimizer.step()
        blob.tensor = torch.zeros(1000)
        ckpt.save(step=4).wait()
    versions = CheckpointDir(small_fs).committed_versions()
    assert versions == [1, 2, 4]
    assert load_version(small_fs / "v00000002").manifest.step == 2
    assert not [p for p in small_fs.iterdir() if p.name.endswith(".tmp")]


class Unwritable:
    """Make a directory unwritable for this process: chattr +i as root, chmod otherwise."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        if os.geteuid() == 0:
            result = subprocess.run(["chattr", "+i", str(self.path)], capture_output=True)
            if result.returncode:
                pytest.skip(f"chattr +i unsupported here: {result.stderr.decode().strip()}")
        else:
            self.path.chmod(0o555)

    def __exit__(self, *exc):
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(self.path)], check=True)
        else:
            self.path.chmod(0o755)


def test_permission_error_is_clear_and_keeps_last_version(tmp_path):
    model = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path, model=model) as ckpt:
        ckpt.save(step=1).wait()
        with Unwritable(tmp_path):
            ckpt.save(step=2)
            with pytest.raises(SaveError, match=r"permission denied.*make the directory writable"):
                ckpt.wait()
        ckpt.save(step=3).wait()  # training and checkpointing go on
    assert CheckpointDir(tmp_path).committed_versions() == [1, 3]
    assert load_version(tmp_path / "v00000001").manifest.step == 1


def test_unwritable_directory_fails_at_construction(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    with Unwritable(target), pytest.raises(CheckpointError, match=r"cannot write checkpoints"):
        Checkpointer(target, model=torch.nn.Linear(2, 2))


def test_background_error_surfaces_at_next_call(tmp_path):
    model = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path, model=model) as ckpt:
        ckpt.save(step=1).wait()
        # Make the next version's staging directory impossible to create.
        (tmp_path / "v00000002.tmp").write_text("in the way")
        handle = ckpt.save(step=2)
        # Finished (outcome() waits without raising or claiming the failure); the next
        # engine call raises it. (Not calls 10 ms apart for 2 s, which a busy machine
        # could outlast.)
        assert handle.outcome(30)[0] == SaveStatus.FAILED
        with pytest.raises(SaveError, match=r"version 2 \(step 2\) failed in stage 'persist'"):
            ckpt.maybe_save(3)
        # Reported once, not again.
        ckpt.wait()
    assert CheckpointDir(tmp_path).committed_versions() == [1]
