"""A Checkpointer never prunes versions it found in its folder unless it took them over.

keep_last counts every committed version of the folder, so a run pointed (by mistake, or by
a shared default like ``checkpoints/``) at a folder holding another model's or another
run's versions deleted them as soon as its own saves outnumbered keep_last, without a word.
"""

from __future__ import annotations

import re

import pytest
import torch

import pcframe
from pcframe import Checkpointer
from pcframe.errors import CheckpointError, StateMismatch
from pcframe.store.directory import CheckpointDir
from pcframe.store.tiers import Tiers


def other_run(root, steps=(1, 2)) -> torch.nn.Module:
    """Another model's run that committed one version per step into ``root``."""
    model = torch.nn.Linear(4, 4)
    with Checkpointer(root, model=model, keep_last=2) as ckpt:
        for step in steps:
            ckpt.save(step).wait()
    return model


def intact(root, model: torch.nn.Module, versions: list[int]) -> None:
    """``versions`` are still committed and load into the other run's model."""
    assert CheckpointDir(root).committed_versions() == versions
    for version in versions:
        pcframe.load(root, model=torch.nn.Linear(4, 4), version=version)
    assert pcframe.load(root, model=model) is not None


def test_a_new_run_that_did_not_restore_cannot_prune_the_folders_versions(tmp_path):
    model = other_run(tmp_path)
    new = torch.nn.Linear(8, 8)  # another model: a mistaken folder, not a restart
    with Checkpointer(tmp_path, model=new, keep_last=2) as ckpt:
        refused = re.escape(str(tmp_path)) + r" holds committed versions 1-2 .*restore\(\) first"
        with pytest.raises(CheckpointError, match=refused) as caught:
            ckpt.save(10)
        assert "\n" not in str(caught.value)
        assert "take_over=True" in str(caught.value)
        with pytest.raises(CheckpointError, match="holds committed versions"):
            ckpt.save(11)  # refused every time, not only once
    intact(tmp_path, model, [1, 2])


def test_a_restore_that_does_not_fit_takes_nothing_over(tmp_path):
    """The restore is refused (another model's state): the run then starts from scratch in
    the same folder, and its saves must not delete what it could not load."""
    model = other_run(tmp_path)
    with Checkpointer(tmp_path, model=torch.nn.Linear(8, 8), keep_last=1) as ckpt:
        with pytest.raises(StateMismatch):
            ckpt.restore()
        with pytest.raises(CheckpointError, match="holds committed versions 1-2"):
            ckpt.save(1)
    intact(tmp_path, model, [1, 2])


def test_a_run_that_restored_continues_and_prunes_as_before(tmp_path):
    """Restoring takes the folder over: the restarted run's keep_last applies to it all."""
    other_run(tmp_path)
    model = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path, model=model, keep_last=2) as ckpt:
        with pytest.raises(CheckpointError, match="did not restore"):
            ckpt.save(3)
        assert ckpt.restore() == 2
        for step in (3, 4):
            ckpt.save(step).wait()
    assert CheckpointDir(tmp_path).committed_versions() == [3, 4]


def test_take_over_lets_a_new_run_replace_the_folders_versions(tmp_path):
    other_run(tmp_path)
    with Checkpointer(tmp_path, model=torch.nn.Linear(8, 8), keep_last=2, take_over=True) as c:
        for step in (1, 2):
            c.save(step).wait()
    assert CheckpointDir(tmp_path).committed_versions() == [3, 4]


def test_a_new_vm_with_an_empty_folder_cannot_prune_the_versions_its_replica_holds(tmp_path):
    """A preempted VM's folder is gone; the next VM's run opens an empty one beside the same
    replica tier (an object store, here a second folder), which holds the previous run's
    versions. Without a restore its saves would make the tier's retention delete them."""
    replica = tmp_path / "replica"

    def opened(folder, **kw) -> Checkpointer:
        tiers = Tiers({"replica": replica}, backoff=0.05, backoff_max=0.2)
        return Checkpointer(folder, model=torch.nn.Linear(4, 4), keep_last=2, tiers=tiers, **kw)

    with opened(tmp_path / "vm1") as ckpt:
        for step in (1, 2):
            ckpt.save(step).wait()
        assert ckpt.tiers.wait_idle(30)
    assert CheckpointDir(replica).committed_versions() == [1, 2]
    with opened(tmp_path / "vm2") as ckpt:
        refused = r"tier 'replica' holds committed versions 1-2 that this Checkpointer did not"
        with pytest.raises(CheckpointError, match=refused) as caught:
            ckpt.save(3)
        assert "\n" not in str(caught.value) and "take_over=True" in str(caught.value)
    assert CheckpointDir(replica).committed_versions() == [1, 2]
    with opened(tmp_path / "vm3") as ckpt:  # the fix the line names: restore first
        assert ckpt.restore() == 2  # from the replica
        for step in (3, 4):
            ckpt.save(step).wait()
        assert ckpt.tiers.wait_idle(30)
    assert CheckpointDir(replica).committed_versions() == [3, 4]
