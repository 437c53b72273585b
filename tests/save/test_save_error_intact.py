"""A failed version says the last committed checkpoint is intact only where there is one.

Before, every SaveError ended "The last committed checkpoint is intact; training may
continue.", also when the first save in a directory failed: then there was no checkpoint at
all, and a job told its progress was safe had none to restore.
"""

from __future__ import annotations

import errno

import pytest
import torch

from pcframe import Checkpointer, SaveError
from pcframe.errors import INTACT, NONE_COMMITTED
from pcframe.integrations._common import stopped_by
from pcframe.save.status import SaveStatus
from pcframe.store.directory import CheckpointDir


def in_the_way(directory, version: int) -> None:
    """A file where the version's staging directory goes: its persist stage fails."""
    (directory / f"v{version:08d}.tmp").write_text("in the way")


def failure(ckpt: Checkpointer, step: int, how: str) -> SaveError:
    """The SaveError of a save at ``step``, raised by its handle or by the next call."""
    handle = ckpt.save(step=step)
    if how != "wait":
        # Finished (outcome() neither raises nor claims the failure): the next engine call
        # raises it. (Not calls 10 ms apart for at most 5 s.)
        assert handle.outcome(30)[0] == SaveStatus.FAILED
    with pytest.raises(SaveError) as info:
        if how == "wait":
            handle.wait()
        else:
            ckpt.maybe_save(step)
    return info.value


@pytest.mark.parametrize("how", ["wait", "next call"])
def test_a_failed_first_save_says_none_was_committed_and_a_later_one_intact(tmp_path, how):
    with Checkpointer(tmp_path, model=torch.nn.Linear(4, 4)) as ckpt:
        in_the_way(tmp_path, 1)
        first = failure(ckpt, 1, how)
        assert "failed in stage 'persist'" in str(first)
        assert "intact" not in str(first) and str(first).endswith(NONE_COMMITTED)
        assert not first.committed_before
        (tmp_path / "v00000001.tmp").unlink()
        ckpt.save(step=2).wait()
        in_the_way(tmp_path, 3)
        later = failure(ckpt, 3, how)
        assert str(later).endswith(INTACT) and NONE_COMMITTED not in str(later)
        assert later.committed_before
    assert CheckpointDir(tmp_path).committed_versions() == [2]


def test_a_first_save_refused_its_staging_pool_says_none_was_committed(tmp_path):
    with Checkpointer(tmp_path, model=torch.nn.Linear(4, 4)) as ckpt:
        ckpt.config.staging_bytes = 1 << 50  # as if configured: a petabyte of staging
        with pytest.raises(SaveError, match="cannot allocate a staging pool") as first:
            ckpt.save(1)
        assert "intact" not in str(first.value) and str(first.value).endswith(NONE_COMMITTED)
        ckpt.config.staging_bytes = 1 << 20
        ckpt.save(2).wait()
        ckpt.config.staging_bytes = 1 << 50
        with pytest.raises(SaveError, match="cannot allocate a staging pool") as later:
            ckpt.save(3)
        assert str(later.value).endswith(INTACT)


def test_a_version_committed_by_an_earlier_run_is_the_intact_one(tmp_path):
    with Checkpointer(tmp_path, model=torch.nn.Linear(4, 4)) as ckpt:
        ckpt.save(step=1).wait()
    with Checkpointer(tmp_path, model=torch.nn.Linear(4, 4), take_over=True) as ckpt:
        in_the_way(tmp_path, 2)
        assert str(failure(ckpt, 2, "wait")).endswith(INTACT)


def test_a_callback_stopped_by_a_failed_first_save_promises_nothing_to_resume_from():
    error = SaveError(1, 5, "persist", OSError(errno.EIO, "Input/output error"), False)
    for finished in (False, True):
        told = str(stopped_by(error, "PcframeCallback", 5, finished, "run trainer.fit() again"))
        assert "intact" not in told and "resume from it" not in told
        assert "No version was committed in this directory" in told
        assert told.count("Input/output error") == 1
    told = str(stopped_by(SaveError(2, 9, "persist", OSError(5, "EIO")), "C", 9, False, "again"))
    assert "The last committed checkpoint is intact: fix the cause and again" in told


def test_a_rank_failure_without_a_committed_version_keeps_its_words_in_the_round():
    """A multi-rank round wraps a rank's SaveError: the round's message follows it."""
    inner = SaveError(1, 9, "persist", OSError(27, "File too large"), committed_before=False)
    outer = SaveError(1, 9, "round", RuntimeError(f"not global: rank 1 failed: {inner}"))
    assert str(outer).count(NONE_COMMITTED) == 1 and INTACT not in str(outer)
    assert not outer.committed_before
