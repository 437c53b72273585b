"""A writer that cannot open its directory says so clearly and does not keep the lock.

``WritableCheckpointDir.__init__`` takes the writer lock, then writes its pid into the lock
file, removes leftovers and takes the ``.clean-exit`` mark (unlink + fsync of the root). A
failure in any of those steps must surface as a :class:`~pcframe.errors.CheckpointError`
naming the file (not a raw ``OSError``), and must release the lock: otherwise the same
process can never open the directory again ("being written by another live process" with
its own pid).

Found by ``experiments/faults/campaign.py`` (hostile ``cleanexit_dir``; I/O faults in the
``open`` phase on ``fsync`` and ``pwrite``).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

from pcframe import Checkpointer
from pcframe.errors import CheckpointError


def _one_version(root: Path) -> None:
    with Checkpointer(root, model=torch.nn.Linear(4, 4), chunk_bytes=4096) as ckpt:
        assert ckpt.save(1).wait(30) == "committed"


def _open_again(root: Path) -> None:
    """The same process opens the directory again once the fault is gone."""
    with Checkpointer(root, model=torch.nn.Linear(4, 4), chunk_bytes=4096) as ckpt:
        assert ckpt.restore() == 1
        assert ckpt.save(2).wait(30) == "committed"


def _open_clearly(root: Path, what: str) -> None:
    try:
        ckpt = Checkpointer(root, model=torch.nn.Linear(4, 4), chunk_bytes=4096)
    except CheckpointError:
        return  # refused, with a message: acceptable
    except Exception as exc:
        pytest.fail(f"{what}: Checkpointer() raised {type(exc).__name__}: {exc}")
    ckpt.close()


@pytest.mark.parametrize("kind", ["dir", "fifo", "symlink"])
def test_hostile_clean_exit_mark(tmp_path, kind):
    root = tmp_path / "ckpt"
    _one_version(root)
    mark = root / ".clean-exit"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("outside the checkpoint directory")
    mark.unlink(missing_ok=True)
    if kind == "dir":
        mark.mkdir()
        (mark / "inner").write_text("x")
    elif kind == "fifo":
        os.mkfifo(mark)
    else:
        os.symlink(outside, mark)
    _open_clearly(root, f"a .clean-exit {kind}")
    assert sorted(os.listdir(outside)) == ["keep"]  # nothing changed through a link
    if mark.is_dir() and not mark.is_symlink():
        shutil.rmtree(mark)
    elif os.path.lexists(mark):
        mark.unlink()
    _open_again(root)


@pytest.mark.parametrize("function", ["fsync", "pwrite"])
def test_io_error_while_the_writer_opens(tmp_path, monkeypatch, function):
    """One EIO from fsync (taking .clean-exit) or pwrite (the pid into .writer.lock)."""
    root = tmp_path / "ckpt"
    _one_version(root)  # a clean close: the next writer takes the .clean-exit mark
    original = getattr(os, function)
    left = [1]

    def failing(fd, *args):
        if left[0] and os.readlink(f"/proc/self/fd/{fd}").startswith(str(root)):
            left[0] -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(root))
        return original(fd, *args)

    monkeypatch.setattr(os, function, failing)
    _open_clearly(root, f"EIO from os.{function}")
    monkeypatch.setattr(os, function, original)
    assert not left[0], "the fault was never hit"
    _open_again(root)
