"""The engine counts writers that died before committing (``Restarted.unseen_starts``).

Real processes open the directory and are SIGKILLed; the restoring process must tell its
policy how many of them died unseen, as the simulator does, or a policy learns only from
lives long enough to checkpoint.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from pcframe import Checkpointer
from pcframe.format.manifest import read_manifest
from pcframe.policies import FixedSteps
from pcframe.policies.base import Restarted
from pcframe.store.directory import STARTS, Starts, WritableCheckpointDir


class Recording(FixedSteps):
    """FixedSteps that keeps every event it is told (not saved with the checkpoint)."""

    def __init__(self) -> None:
        super().__init__(100)
        self.events: list[object] = []

    def observe(self, event) -> None:
        self.events.append(event)
        super().observe(event)


def run_writer(root, save: bool, ending: str) -> None:
    """A separate process opens ``root`` for writing, maybe commits, then ends."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        from pcframe import Checkpointer
        ckpt = Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2))
        if {save}:
            ckpt.save(7).wait()
        {ending}
        """
    )
    subprocess.run([sys.executable, "-c", script, str(root)], timeout=120, check=False)


KILLED = "os.kill(os.getpid(), signal.SIGKILL)"
CLOSED = "ckpt.close()"


def restarted(root) -> list[Restarted]:
    policy = Recording()
    with Checkpointer(root, model=torch.nn.Linear(2, 2), policy=policy) as ckpt:
        ckpt.restore()
    return [e for e in policy.events if isinstance(e, Restarted)]


def test_writers_killed_after_the_restored_version_are_counted(tmp_path):
    run_writer(tmp_path, save=True, ending=KILLED)  # writer 1 commits, then dies
    run_writer(tmp_path, save=False, ending=KILLED)  # 2 and 3 die before committing
    run_writer(tmp_path, save=False, ending=KILLED)
    (event,) = restarted(tmp_path)  # writer 4
    # Three deaths since the version: the newest is this Restarted, two are unseen.
    assert (event.step, event.clean, event.unseen_starts) == (7, False, 2)


def test_a_clean_close_after_the_version_is_not_a_death(tmp_path):
    run_writer(tmp_path, save=True, ending=CLOSED)  # writer 1 commits and closes cleanly
    run_writer(tmp_path, save=False, ending=KILLED)  # writer 2 dies: the one Restarted
    (event,) = restarted(tmp_path)
    assert (event.clean, event.unseen_starts) == (False, 0)
    (event,) = restarted(tmp_path)  # writer 3 closed cleanly just now
    assert (event.clean, event.unseen_starts) == (True, 0)


def test_nothing_to_restore_still_reports_the_dead_writers(tmp_path):
    run_writer(tmp_path, save=False, ending=KILLED)
    run_writer(tmp_path, save=False, ending=KILLED)
    (event,) = restarted(tmp_path)
    assert (event.step, event.unseen_starts) == (0, 1)


def test_a_first_start_reports_no_restart(tmp_path):
    assert restarted(tmp_path) == []


def test_the_version_records_its_writer(tmp_path):
    for expected in (1, 2):
        with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt:
            ckpt.save(expected).wait()
            assert ckpt.storage.starts.number == expected
    manifest = read_manifest(str(tmp_path / "v00000002" / "manifest.json"))
    assert manifest.engine["writer_start"] == 2


@pytest.mark.parametrize(
    ("starts", "written_by", "unseen"),
    [
        (Starts(5, 0), 2, 2),  # writers 2, 3, 4 died: 4 is the Restarted itself
        (Starts(5, 3), 2, 0),  # 3 closed cleanly after 2's version; 4 died
        (Starts(5, 4), 2, 0),  # the previous writer closed cleanly
        (Starts(5, 0), None, 3),  # nothing restored: 1..4 died, 4 is the Restarted
        (Starts(5, 0), 0, 0),  # unknown writer (older manifest)
        (Starts(2, 0), 9, 0),  # counted afresh since the version was written
        (Starts(0, 0), 1, 0),  # no count (the file could not be written)
    ],
)
def test_unseen_arithmetic(starts, written_by, unseen):
    assert starts.unseen(written_by) == unseen


@pytest.mark.parametrize("content", [b"garbage", b'{"starts": -1, "last_clean": 0}', b"{}"])
def test_a_damaged_count_is_restarted_with_a_warning(tmp_path, caplog, content):
    (tmp_path / STARTS).write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="pcframe"):
        storage = WritableCheckpointDir(tmp_path)
    storage.close()
    assert storage.starts == Starts(1, 0)
    assert any(STARTS in r.getMessage() for r in caplog.records)


def test_an_unwritable_count_does_not_stop_training(tmp_path, caplog):
    (tmp_path / STARTS).mkdir()  # a directory where the count goes: cannot be replaced
    with (
        caplog.at_level(logging.WARNING, logger="pcframe"),
        Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt,
    ):
        ckpt.save(1).wait()
        assert ckpt.storage.starts == Starts()
    assert any(STARTS in r.getMessage() for r in caplog.records)
