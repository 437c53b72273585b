"""A multi-rank restore treats an I/O error as an I/O error, not as corruption.

The single-rank restore retries a read that fails with ``OSError`` and, if it keeps failing,
raises ``RestoreIOError`` without going back to an older version (``restore/sources.py``,
docs/fault-model.md). ``DistributedCheckpointer.restore`` must keep the same promise: one
EIO on one rank must not make every rank skip the newest global version and silently resume
an older one, and a persistent EIO must raise ``RestoreIOError`` rather than
``NoValidCheckpoint`` ("no valid global checkpoint"), which tells the user the checkpoints
are bad when the storage is.

Two real gloo ranks (``tests/faults/harness.py``); the fault is an ``os.preadv`` EIO on
rank 1, armed only around ``restore()``.
"""

from __future__ import annotations

import shutil

import pytest

from tests.faults.harness import check_global, run_children


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    top = tmp_path_factory.mktemp("dist-io")
    config = {"mode": "dist", "root": str(top / "ckpt"), "limit": 4, "exit_code": 0}
    built = run_children("save", config, timeout=120, logdir=top / "logs")
    assert built.returncodes == [0, 0], built.tail()
    steps = check_global(top / "ckpt", {})
    assert steps and max(steps) == 4, steps
    return top / "ckpt"


def _resume_with_eio(base, tmp_path, times: int):
    root = tmp_path / "ckpt"
    shutil.copytree(base, root)
    io = {"fn": "preadv", "err": "EIO", "after": 0, "times": times, "rank": 1}
    resumed = run_children("resume", {"mode": "dist", "root": str(root), "io": io}, timeout=90)
    assert not resumed.timed_out, resumed.tail()
    return resumed


@pytest.mark.slow
def test_one_transient_eio_on_one_rank_still_restores_the_newest(base, tmp_path):
    resumed = _resume_with_eio(base, tmp_path, times=1)
    assert resumed.returncodes == [0, 0], resumed.tail()
    for rank in range(2):
        got = resumed.result(rank)
        assert got["step"] == 4, (
            f"rank {rank}: one EIO made the restore skip global v4 and resume step "
            f"{got['step']}; skipped: {got['skipped']}"
        )
        assert got["stamped"] and got["status"] == "committed", got


@pytest.mark.slow
def test_a_persistent_eio_is_reported_as_an_io_error(base, tmp_path):
    resumed = _resume_with_eio(base, tmp_path, times=-1)
    error = resumed.result(1).get("error", "")
    assert error.startswith("RestoreIOError"), f"rank 1 restore raised {error!r}"
