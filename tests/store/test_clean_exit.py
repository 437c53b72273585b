"""Only a normal close marks a clean exit; save_last saves the final step at a normal close."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pcframe import Checkpointer
from pcframe.policies import FixedSteps
from pcframe.store.directory import CLEAN_EXIT, CheckpointDir
from tests.helpers import commits_in_save_order


def clean_mark(root) -> bool:
    return (root / CLEAN_EXIT).exists()


def test_with_block_left_by_an_exception_is_not_a_clean_exit(tmp_path):
    with pytest.raises(ValueError), Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt:
        ckpt.save(1).wait()
        raise ValueError("training crashed")
    assert not clean_mark(tmp_path)
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt:
        assert ckpt._storage.previous_exit_clean is False
    assert clean_mark(tmp_path)  # this one closed normally
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt:
        assert ckpt._storage.previous_exit_clean is True


@pytest.mark.parametrize(
    ("ending", "clean"),
    [("pass", True), ("raise SystemExit(0)", True), ("raise RuntimeError('boom')", False)],
)
def test_interpreter_exit_without_close(tmp_path, ending, clean):
    script = textwrap.dedent(
        f"""
        import sys, torch
        from pcframe import Checkpointer
        ckpt = Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2))
        ckpt.save(1)
        {ending}
        """
    )
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, timeout=60, check=False
    )
    assert CheckpointDir(tmp_path).committed_versions() == [1]  # atexit finished the save
    assert clean_mark(tmp_path) is clean


def test_save_last_saves_the_final_step_once(tmp_path):
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path, model=model, policy=FixedSteps(10), save_last=True) as ckpt:
        # Two may be in flight: one finishing after a newer one is discarded (by design),
        # and fewer than the 3 versions asserted below would stand.
        commits_in_save_order(ckpt)
        for step in range(1, 26):
            ckpt.maybe_save(step)
    directory = CheckpointDir(tmp_path)
    steps = [ckpt.records[v].step for v in sorted(ckpt.records)]
    assert steps == [10, 20, 25]
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), save_last=True) as again:
        assert again.restore() == 25
    assert len(directory.committed_versions()) == 3  # nothing new to save: no extra version


def test_save_last_is_opt_in_and_skipped_on_an_exception(tmp_path):
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), policy=FixedSteps(10)) as ckpt:
        for step in range(1, 16):
            ckpt.maybe_save(step)
    assert [ckpt.records[v].step for v in sorted(ckpt.records)] == [10]
    other = tmp_path / "other"
    with (
        pytest.raises(KeyError),
        Checkpointer(
            other, model=torch.nn.Linear(2, 2), policy=FixedSteps(10), save_last=True
        ) as ckpt,
    ):
        for step in range(1, 16):
            ckpt.maybe_save(step)
        raise KeyError("crash")
    assert [ckpt.records[v].step for v in sorted(ckpt.records)] == [10]
