"""A preemption notice sends the emergency version to the fastest tier that survives the VM."""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path

import pytest

import pcframe.policies as P
from pcframe import Checkpointer
from pcframe.store.directory import CheckpointDir
from pcframe.store.tiers import Secured, Tiers
from tests.store.tiers.helpers import model_and_optimizer, same, snapshot, step


def make(
    primary: Path, disk: Path, model, opt, notices, *, policy=None, disk_every: int = 3
) -> Checkpointer:
    """Every step saved to memory (by default); only every ``disk_every``-th version also
    copied to disk."""
    return Checkpointer(
        primary,
        model=model,
        optimizer=opt,
        policy=policy or P.NoticeDriven(P.FixedSteps(1), save_time_prior=0.5, margin=1.0),
        tiers=Tiers({"local": disk}),
        placement=P.MemoryThenDisk(memory_keep=2, disk_keep=2, disk_every=disk_every),
        notices=notices,
        keep_last=2,
        chunk_bytes=8192,
    )


def test_emergency_version_goes_to_disk_not_memory(shm_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    source = P.ManualNoticeSource(window=30.0)
    model, opt = model_and_optimizer()
    with make(shm_dir, disk, model, opt, source) as ckpt:
        for s in range(1, 8):
            step(model, opt, s)
            ckpt.maybe_save(s)
            ckpt.wait()
            assert ckpt.tiers.wait_idle(30)
        assert CheckpointDir(disk).committed_versions() == [3, 6]
        # the engine measured both tiers and offers the estimates to the policies
        times = ckpt.context(7).tier_write_times
        assert set(times) == {"memory", "local"} and times["local"] >= times["memory"] > 0
        step(model, opt, 8)
        source.trigger(time.monotonic())  # e.g. SIGTERM from the spot agent: 30 s left
        handle = ckpt.maybe_save(8)
        assert handle is not None and ckpt.last_decision.emergency
        secured = ckpt.last_secured
        assert secured.version == 8 and secured.tiers == ("local",) and secured.durable
        assert "notice: local writes in" in secured.reason  # memory does not survive the VM
        # durable on disk when maybe_save returned, although 8 is no multiple of 3
        assert 8 in CheckpointDir(disk).committed_versions()
        assert ckpt.notice is not None
        expected = snapshot(model)
    shutil.rmtree(shm_dir)  # the VM is gone, and its memory with it
    model2, opt2 = model_and_optimizer(seed=3)
    with make(shm_dir, disk, model2, opt2, P.ManualNoticeSource()) as ckpt:
        assert ckpt.restore() == 8 and ckpt.last_restore.tier == "local"
        assert same(snapshot(model2), expected)


def test_a_notice_too_short_for_a_save_relies_on_the_last_periodic_one(
    shm_dir: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    source = P.ManualNoticeSource()
    model, opt = model_and_optimizer()
    with make(shm_dir, disk, model, opt, source) as ckpt:
        for s in range(1, 4):
            step(model, opt, s)
            ckpt.maybe_save(s)
            ckpt.wait()
        source.trigger(time.monotonic(), window=0.5)  # less than the 1 s margin alone
        step(model, opt, 4)
        assert ckpt.maybe_save(4) is None
        assert "relying on the last periodic checkpoint" in ckpt.last_decision.reason
        # no time for a save, but the newest version (3, on disk already) is where it survives
        assert ckpt.last_secured == Secured(3, ("local",), True, ckpt.last_secured.reason)
        assert CheckpointDir(shm_dir).committed_versions()[-1] == 3
        assert ckpt.tiers.status()["local"].written == 1  # 3: not written again


def test_a_notice_at_a_step_saved_already_sends_that_version_where_it_survives(
    shm_dir: Path, tmp_path: Path
) -> None:
    """The loop saved step 5 (to memory only: not a 3rd version) and then the notice came:
    the policy saves nothing new, and version 5 is copied to disk within the window
    (before: the notice secured nothing, and the VM's loss lost step 5 though the window
    had room to copy it)."""
    disk = tmp_path / "disk"
    source = P.ManualNoticeSource(window=30.0)
    model, opt = model_and_optimizer()
    with make(shm_dir, disk, model, opt, source) as ckpt:
        for s in range(1, 6):
            step(model, opt, s)
            ckpt.save(s).wait()
        assert ckpt.tiers.wait_idle(30) and CheckpointDir(disk).committed_versions() == [3]
        source.trigger(time.monotonic())
        assert ckpt.maybe_save(5) is None
        assert "already saved" in ckpt.last_decision.reason
        secured = ckpt.last_secured
        assert (secured.version, secured.tiers, secured.durable) == (5, ("local",), True)
        assert CheckpointDir(disk).committed_versions() == [3, 5]
        step(model, opt, 6)
        assert ckpt.maybe_save(6) is None and ckpt.last_secured is secured  # the same notice
        expected = snapshot(model)
        ckpt.close()
    shutil.rmtree(shm_dir)  # the VM is gone, and its memory with it
    model2, opt2 = model_and_optimizer(seed=3)
    with make(shm_dir, disk, model2, opt2, P.ManualNoticeSource()) as ckpt:
        assert ckpt.restore() == 5 and ckpt.last_restore.tier == "local"
        step(model2, opt2, 6)
        assert same(snapshot(model2), expected)


def test_a_version_the_tier_holds_already_is_not_written_again_on_a_notice(
    shm_dir: Path, tmp_path: Path
) -> None:
    """Every version goes to disk; a notice at a step saved and copied already: the copy is
    not rewritten (a rewrite first removes the copy it replaces, and the close in a hurry
    after a notice cut the rewrite off: no copy was left)."""
    disk = tmp_path / "disk"
    source = P.ManualNoticeSource(window=30.0)
    model, opt = model_and_optimizer()
    with make(shm_dir, disk, model, opt, [source], disk_every=1) as ckpt:
        for s in range(1, 4):
            step(model, opt, s)
            ckpt.maybe_save(s)
            ckpt.wait()
            assert ckpt.tiers.wait_idle(30)
        source.trigger(time.monotonic())
        assert ckpt.maybe_save(3) is None and ckpt.last_secured.version == 3
        assert ckpt.last_secured.durable
        assert ckpt.tiers.wait_idle(30)
        status = ckpt.tiers.status()["local"]
        assert (status.written, status.failures) == (3, 0)
        step(model, opt, 4)
        source.trigger(time.monotonic() + 1.0)  # a second notice: 4 is saved and secured
        assert ckpt.maybe_save(4) is not None and ckpt.last_secured.version == 4
        assert ckpt.tiers.wait_idle(30) and ckpt.tiers.status()["local"].written == 4
    assert CheckpointDir(disk).committed_versions() == [3, 4]


def test_a_polled_file_notice_passed_by_the_checkpointer_triggers_the_save(tmp_path: Path):
    flag = tmp_path / "preempt"
    model, opt = model_and_optimizer()
    with Checkpointer(
        tmp_path / "ckpt",
        model=model,
        optimizer=opt,
        # the policy has no source of its own: the Checkpointer polls and passes ctx.notice
        policy=P.NoticeDriven(P.FixedSteps(1000), save_time_prior=0.5, margin=1.0),
        notices=[P.FileNoticeSource(str(flag), window=60.0, poll_interval=0.0)],
    ) as ckpt:
        for s in range(1, 4):
            step(model, opt, s)
            assert ckpt.maybe_save(s) is None and ckpt.notice is None
        flag.write_text("25")  # e.g. written by a watcher of the cloud metadata endpoint
        step(model, opt, 4)
        handle = ckpt.maybe_save(4)
        assert handle is not None and ckpt.last_decision.emergency
        assert handle.done()  # maybe_save returned only once the version was durable
        assert ckpt.notice is not None and ckpt.notice.source.startswith("file:")
        assert ckpt.last_secured is None  # no tiers: the primary is the only place
    assert CheckpointDir(tmp_path / "ckpt").committed_versions() == [1]


def notice_after_five_saves(shm_dir: Path, disk: Path, policy, notices):
    """Steps 1-5 saved (to memory; to disk every 3rd version), before a notice: the
    checkpointer and the model."""
    model, opt = model_and_optimizer()
    ckpt = make(shm_dir, disk, model, opt, notices, policy=policy)
    for s in range(1, 6):
        step(model, opt, s)
        ckpt.save(s).wait()
    assert ckpt.tiers.wait_idle(30) and CheckpointDir(disk).committed_versions() == [3]
    return ckpt, model


def test_a_policys_own_notice_source_secures_the_newest_version_too(shm_dir, tmp_path):
    """NoticeDriven(inner, source) without notices=: the notice was read only when the
    policy asked for an emergency save, so one it answered without a save secured nothing
    (and ``ckpt.notice`` stayed None: the loop trained on)."""
    source = P.ManualNoticeSource(window=30.0)
    policy = P.NoticeDriven(P.FixedSteps(1000), source, save_time_prior=0.5, margin=1.0)
    ckpt, _ = notice_after_five_saves(shm_dir, tmp_path / "disk", policy, None)
    with ckpt:
        source.trigger(time.monotonic())
        assert ckpt.maybe_save(5) is None and ckpt.notice is not None
        assert ckpt.last_secured.version == 5 and ckpt.last_secured.durable
    assert CheckpointDir(tmp_path / "disk").committed_versions() == [3, 5]


def test_a_policy_that_reads_no_notices_saving_at_the_notices_step_secures_that_version(
    shm_dir, tmp_path
):
    source = P.ManualNoticeSource(window=30.0)
    ckpt, model = notice_after_five_saves(shm_dir, tmp_path / "disk", P.FixedSteps(1), [source])
    with ckpt:
        source.trigger(time.monotonic())
        step(model, ckpt.optimizer, 6)
        handle = ckpt.maybe_save(6)  # a routine save at the notice's step
        assert handle.version == 6 and ckpt.last_secured.version == 6
        assert ckpt.last_secured.durable
    assert CheckpointDir(tmp_path / "disk").committed_versions() == [3, 6]


def test_a_notice_without_a_deadline_is_answered_once_and_never_overflows(shm_dir, tmp_path):
    """An infinite window: Condition.wait raised OverflowError at every maybe_save, and
    inf - inf (NaN) made the notice new at every step."""
    source = P.ManualNoticeSource()
    policy = P.NoticeDriven(P.FixedSteps(1000), save_time_prior=0.5, margin=1.0)
    ckpt, model = notice_after_five_saves(shm_dir, tmp_path / "disk", policy, [source])
    with ckpt:
        source.trigger(time.monotonic(), window=math.inf)
        assert ckpt.maybe_save(5) is None and ckpt.last_secured.version == 5
        secured = ckpt.last_secured
        step(model, ckpt.optimizer, 6)
        assert ckpt.maybe_save(6) is None and ckpt.last_secured is secured  # once


def saved_to_both(primary: Path, disk: Path, seed: int = 0) -> None:
    """Steps 1-3 saved by one process, every version copied to disk (which keeps 2 and 3)."""
    model, opt = model_and_optimizer(seed=seed)
    with make(primary, disk, model, opt, [], disk_every=1) as ckpt:
        for s in range(1, 4):
            step(model, opt, s)
            ckpt.save(s).wait()
            assert ckpt.tiers.wait_idle(30)
    assert CheckpointDir(disk).committed_versions() == [2, 3]


def secured_after_a_restart(primary: Path, disk: Path) -> Checkpointer:
    """A new process restores version 3 and gets a notice it answers without a save (a
    window shorter than the policy's margin): the checkpointer, still open."""
    source = P.ManualNoticeSource(window=60.0)
    relying = P.NoticeDriven(P.FixedSteps(1), save_time_prior=0.5, margin=120.0)
    model, opt = model_and_optimizer(seed=3)
    ckpt = make(primary, disk, model, opt, [source], policy=relying, disk_every=1)
    assert ckpt.restore() == 3
    source.trigger(time.monotonic())
    step(model, opt, 4)
    assert ckpt.maybe_save(4) is None
    assert "relying on the last periodic checkpoint" in ckpt.last_decision.reason
    return ckpt


def test_a_notice_after_a_restart_secures_the_restored_version_the_tier_holds(
    shm_dir: Path, tmp_path: Path, caplog
) -> None:
    """The disk holds the restored version 3 already, copied there by the process before:
    it is durable there at once (before: the replicator took the disk's own copy for another
    run's version 3, logged two errors and the notice reported version 3 as not durable)."""
    disk = tmp_path / "disk"
    saved_to_both(shm_dir, disk)
    with secured_after_a_restart(shm_dir, disk) as ckpt:
        assert ckpt.last_secured == Secured(3, ("local",), True, ckpt.last_secured.reason)
        status = ckpt.tiers.status()["local"]
        assert (status.written, status.abandoned, status.last_error) == (0, 0, "")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert CheckpointDir(disk).committed_versions() == [2, 3]


def test_a_notice_does_not_take_another_runs_version_of_the_same_number_for_its_own(
    shm_dir: Path, tmp_path: Path, caplog
) -> None:
    """The disk's version 3 is another run's (other weights): the primary's version 3 is
    not durable there, and the disk's copy is neither taken for it nor written over."""
    disk, other = tmp_path / "disk", tmp_path / "other"
    saved_to_both(other, disk, seed=5)  # another run, its own primary, the same disk
    written = (disk / "v00000003" / "manifest.json").read_bytes()
    saved_to_both(shm_dir, tmp_path / "elsewhere")
    with secured_after_a_restart(shm_dir, disk) as ckpt:
        secured = ckpt.last_secured
        assert (secured.version, secured.durable) == (3, False)
        assert ckpt.tiers.status()["local"].abandoned == 1
    assert "already holds version 3" in caplog.text
    assert (disk / "v00000003" / "manifest.json").read_bytes() == written


def _secured_after_one_save(primary: Path, disk: Path, placement=None, at: int = 1) -> Secured:
    """A save at step ``at`` beside a disk tier, then a notice of 30 s: what it secured."""
    from pcframe.policies.base import Notice

    model, opt = model_and_optimizer()
    options = {"placement": placement} if placement is not None else {}
    with Checkpointer(
        primary,
        model=model,
        optimizer=opt,
        tiers=Tiers({"local": disk}),
        chunk_bytes=8192,
        take_over=True,  # a second call saves into the same primary without restoring
        **options,
    ) as ckpt:
        step(model, opt, at)
        handle = ckpt.save(at)
        handle.wait()
        now = time.monotonic()
        secured = ckpt.tiers.secure(handle.version, at, Notice(now, now + 30))
    assert secured is not None
    return secured


def test_a_notice_never_calls_a_version_safe_in_tiers_lost_with_the_vm(
    shm_dir: Path, tmp_path: Path
) -> None:
    """An instance-store disk (disk_survives_preemption=False) beside the memory tier: no
    tier outlives the VM, the placement falls back to the fastest, and the notice said
    durable=True for a version in /dev/shm only (a new VM then trained from step 0)."""
    placement = P.MemoryThenDisk(
        memory_keep=1, disk_keep=2, disk_every=100, disk_survives_preemption=False
    )
    secured = _secured_after_one_save(shm_dir, tmp_path / "disk", placement)
    assert not secured.durable, secured
    assert "outlives the VM" in secured.reason
    # A disk that does survive (the default): the same notice is safe there.
    placement = P.MemoryThenDisk(memory_keep=1, disk_keep=2, disk_every=100)
    secured = _secured_after_one_save(shm_dir, tmp_path / "disk2", placement, at=2)
    assert secured.durable and secured.tiers == ("local",), secured


def test_without_a_placement_a_notice_goes_to_the_disk_not_the_ram_primary(
    shm_dir: Path, tmp_path: Path
) -> None:
    """The default placement (every tier every version) said every tier survives: a notice
    picked the RAM primary, the fastest, and then (rightly) not durable, leaving the disk
    tier beside it unused."""
    from pcframe.store.tiers import is_memory_backed

    if is_memory_backed(tmp_path):
        pytest.skip(f"{tmp_path} is RAM-backed on this machine: no disk tier to go to")
    secured = _secured_after_one_save(shm_dir, tmp_path / "disk")
    assert secured.durable and secured.tiers == ("local",), secured
