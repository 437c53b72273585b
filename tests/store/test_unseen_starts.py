"""The engine counts writers that died before committing (``Restarted.unseen_starts``).

Real processes open the directory and are SIGKILLed; the restoring process must tell its
policy how many of them died unseen, as the simulator does, or a policy learns only from
lives long enough to checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from pcframe import Checkpointer
from pcframe.format.manifest import read_manifest
from pcframe.policies import FixedSteps
from pcframe.policies.base import Restarted
from pcframe.policies.notices import SignalNoticeSource
from pcframe.store.directory import WritableCheckpointDir
from pcframe.store.starts import STARTS, Starts


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


@pytest.mark.slow
def test_writers_killed_after_the_restored_version_are_counted(tmp_path):
    run_writer(tmp_path, save=True, ending=KILLED)  # writer 1 commits, then dies
    run_writer(tmp_path, save=False, ending=KILLED)  # 2 and 3 die before committing
    run_writer(tmp_path, save=False, ending=KILLED)
    (event,) = restarted(tmp_path)  # writer 4
    # Three deaths since the version: the newest is this Restarted, two are unseen.
    assert (event.step, event.clean, event.unseen_starts) == (7, False, 2)


@pytest.mark.slow
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
        # (take_over: writer 2 saves beside writer 1's version without restoring it)
        with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), take_over=True) as ckpt:
            ckpt.save(expected).wait()
            assert ckpt._storage.starts.number == expected
    manifest = read_manifest(str(tmp_path / "v00000002" / "manifest.json"))
    epoch = Starts.parse((tmp_path / STARTS).read_bytes()).epoch
    expected = written(2, 1, epoch)  # writer 2, after one clean close (writer 1's)
    assert {key: manifest.engine.get(key) for key in expected} == expected


def ended(root, *, restore=False, save=None, clean: bool, **kw) -> list[Restarted]:
    """A writer in this process: maybe restores and saves, then closes cleanly or leaves
    on an exception (no clean-exit mark, as after a kill). Returns its Restarted events."""
    policy = Recording()
    with (
        contextlib.suppress(KeyError),
        Checkpointer(root, model=torch.nn.Linear(2, 2), policy=policy, **kw) as ckpt,
    ):
        if restore:
            ckpt.restore()
        if save is not None:
            ckpt.save(save).wait()
            ckpt.tiers.wait_idle(30)
        if not clean:
            raise KeyError("killed")
    return [e for e in policy.events if isinstance(e, Restarted)]


def test_deaths_before_a_later_clean_close_still_count(tmp_path):
    ended(tmp_path, save=1, clean=False)  # writer 1 commits v1 and dies
    ended(tmp_path, restore=True, clean=True)  # 2 restores v1, closes cleanly without saving
    ended(tmp_path, restore=True, clean=False)  # 3 dies before a commit
    (event,) = ended(tmp_path, restore=True, clean=True)
    # Writers 1 and 3 died since v1: the newest is this Restarted, one is unseen.
    assert (event.clean, event.unseen_starts) == (False, 1)


def test_a_version_written_through_another_directory_is_not_compared(tmp_path):
    # Two machines' primaries share a replica tier: a version machine A wrote carries A's
    # writer number, which says nothing about who died in B's directory.
    a, b, shared = tmp_path / "a", tmp_path / "b", {"t": tmp_path / "shared"}
    for step in (1, 2, 3):
        ended(b, restore=True, save=step, clean=False, tiers=shared)
    ended(a, restore=True, save=4, clean=False, tiers=shared)
    (event,) = ended(b, restore=True, clean=True, tiers=shared)
    assert (event.step, event.unseen_starts) == (4, 0)


def test_a_count_started_afresh_is_not_compared_with_the_old_numbers(tmp_path):
    for step in (1, 2, 3):
        ended(tmp_path, restore=True, save=step, clean=False)
    (tmp_path / STARTS).write_bytes(b"garbage")  # the next writer counts afresh
    for _ in range(4):
        ended(tmp_path, restore=True, clean=False)
    (event,) = ended(tmp_path, restore=True, clean=True)
    assert (event.step, event.unseen_starts) == (3, 0)  # v3's writer is of the old count


class FailingNotice:
    def start(self) -> None:
        raise RuntimeError("a notice source that cannot start")

    def close(self) -> None:
        pass


def test_a_failed_construction_is_not_a_death_and_keeps_the_clean_mark(tmp_path):
    ended(tmp_path, save=1, clean=True)  # writer 1 commits and closes cleanly
    with pytest.raises(RuntimeError):
        Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), notices=[FailingNotice()])
    (event,) = ended(tmp_path, restore=True, clean=True)  # the same process retries
    assert (event.clean, event.unseen_starts) == (True, 0)


def test_a_construction_interrupted_late_leaves_nothing_behind(tmp_path):
    """Ctrl-C as the optimizer gate is installed, after the notice source took its signal:
    the lock, the handler and the clean mark are as they were, and nothing is counted."""
    ended(tmp_path, save=1, clean=True)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    def interrupted(*_):
        raise KeyboardInterrupt

    optimizer.register_step_pre_hook = interrupted
    source = SignalNoticeSource(signals=("SIGUSR1",))
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(KeyboardInterrupt):
        Checkpointer(tmp_path, optimizer=optimizer, notices=[source])
    assert signal.getsignal(signal.SIGUSR1) is before
    (event,) = ended(tmp_path, restore=True, clean=True)  # the lock is free: same process
    assert (event.clean, event.unseen_starts) == (True, 0)


def test_a_notice_source_that_fails_half_way_is_undone(tmp_path):
    """SIGUSR2 is taken, then SIGKILL cannot be: the handler taken is given back."""
    before = signal.getsignal(signal.SIGUSR2)
    source = SignalNoticeSource(signals=("SIGUSR2",))
    # refused when a source is made; put in after that, signal.signal() refuses it at start
    source.signals.append(signal.SIGKILL)
    with pytest.raises(OSError):
        Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), notices=[source])
    assert signal.getsignal(signal.SIGUSR2) is before
    assert ended(tmp_path, clean=True) == []  # the lock is free, nothing was counted


def test_an_optimizer_without_the_step_hook_is_a_clear_error(tmp_path):
    class Wrapper:  # a wrapper exposing the state but not the torch optimizer itself
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    with pytest.raises(TypeError, match=r"optimizer \(Wrapper\) is not a torch.optim.Optimizer"):
        Checkpointer(tmp_path, optimizer=Wrapper())
    assert ended(tmp_path, clean=True) == []  # nothing was locked or counted: a first start


def test_tier_replicas_do_not_count_writers(tmp_path):
    ended(tmp_path / "primary", save=1, clean=True, tiers={"t": tmp_path / "replica"})
    assert not (tmp_path / "replica" / STARTS).exists()
    assert Starts.parse((tmp_path / "primary" / STARTS).read_bytes()).number == 1


EPOCH = "0123456789abcdef"


def written(number: int, clean: int, epoch: str = EPOCH) -> dict:
    return {"writer_start": number, "writer_clean": clean, "writer_epoch": epoch}


@pytest.mark.parametrize(
    ("starts", "version", "unseen"),
    [
        (Starts(5, 0, EPOCH), written(2, 0), 2),  # 2, 3, 4 died: 4 is the Restarted itself
        (Starts(5, 1, EPOCH), written(2, 0), 1),  # one of 2..4 closed cleanly
        (Starts(5, 3, EPOCH), written(2, 0), 0),  # 2, 3 and 4 all closed cleanly
        (Starts(5, 2, EPOCH), written(2, 2), 2),  # the clean closes were before 2
        (Starts(5, 0, EPOCH), None, 3),  # nothing restored: 1..4 died, 4 is the Restarted
        (Starts(5, 1, EPOCH), None, 2),
        (Starts(5, 0, EPOCH), {}, 0),  # unknown writer (an older manifest)
        (Starts(5, 0, EPOCH), written(2, 0, "fedcba9876543210"), 0),  # another count
        (Starts(2, 0, EPOCH), written(9, 0), 0),  # inconsistent numbers: unknown
        (Starts(5, 0, EPOCH), written(2, 1), 0),  # more clean closes then than now
        (Starts(5, 0, EPOCH), {**written(2, 0), "writer_start": True}, 0),
        (Starts(), written(1, 0, ""), 0),  # not counted (the file could not be written)
    ],
)
def test_unseen_arithmetic(starts, version, unseen):
    assert starts.unseen(version) == unseen


@pytest.mark.parametrize(
    "content",
    [
        b"garbage",
        b'{"starts": -1, "clean": 0, "epoch": "0123456789abcdef"}',
        b'{"starts": 2, "clean": 2, "epoch": "0123456789abcdef"}',
        b'{"starts": 2, "clean": 0, "epoch": "../x"}',
        b"{}",
    ],
)
def test_a_damaged_count_is_restarted_with_a_warning(tmp_path, caplog, content):
    (tmp_path / STARTS).write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="pcframe"):
        storage = WritableCheckpointDir(tmp_path)
        starts = storage.count_start()
    storage.close()
    assert (starts.number, starts.clean) == (1, 0) and len(starts.epoch) == 16
    assert any(STARTS in r.getMessage() for r in caplog.records)


def test_an_unwritable_count_does_not_stop_training(tmp_path, caplog):
    (tmp_path / STARTS).mkdir()  # a directory where the count goes: cannot be replaced
    with (
        caplog.at_level(logging.WARNING, logger="pcframe"),
        Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt,
    ):
        ckpt.save(1).wait()
        assert ckpt._storage.starts == Starts()
    assert any(STARTS in r.getMessage() for r in caplog.records)
