"""Memory tier in front of a disk tier: routing, per-tier retention, crash safety, restore."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

import pcframe.policies as P
from pcframe import Checkpointer
from pcframe.restore.reader import load_version
from pcframe.store.directory import CheckpointDir
from pcframe.store.tiers import LocalTier, TierError, Tiers, is_memory_backed, memory_directory
from tests.store.tiers.helpers import model_and_optimizer, same, snapshot, step


def _checkpointer(primary: Path, disk: Path, model, optimizer, **kw) -> Checkpointer:
    placement = kw.pop("placement", P.MemoryThenDisk(memory_keep=1, disk_keep=2, disk_every=2))
    return Checkpointer(
        primary,
        model=model,
        optimizer=optimizer,
        tiers=Tiers({"local": disk}, backoff=0.05, backoff_max=0.2, **kw),
        placement=placement,
        keep_last=1,
        chunk_bytes=8192,
    )


def test_memory_then_disk_routes_keeps_and_restores_after_memory_is_lost(
    shm_dir: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    model, opt = model_and_optimizer()
    states = {}
    with _checkpointer(shm_dir, disk, model, opt) as ckpt:
        assert is_memory_backed(shm_dir)  # the primary really is tmpfs
        for s in range(1, 9):
            step(model, opt, s)
            ckpt.save(s).wait()
            assert ckpt.tiers.wait_idle(30)
            states[s] = snapshot(model)
        status = ckpt.tiers.status()["local"]
        assert status.written == 4 and status.abandoned == 0 and status.lag_versions == 0
        assert ckpt.tiers.write_times(0.0)["local"] > 0.0  # a measured estimate
    # every 2nd version went to disk, which keeps 2; memory keeps 1
    assert CheckpointDir(disk).committed_versions() == [6, 8]
    assert CheckpointDir(shm_dir).committed_versions() == [8]
    assert CheckpointDir(disk).latest_hint() == 8
    assert load_version(disk / "v00000008").manifest.step == 8  # a valid checkpoint directory

    shutil.rmtree(shm_dir)  # the machine rebooted: the memory tier is empty
    model2, opt2 = model_and_optimizer(seed=1)
    with _checkpointer(shm_dir, disk, model2, opt2) as ckpt:
        assert ckpt.restore() == 8
        assert ckpt.last_restore.tier == "local"
        assert same(snapshot(model2), states[8])
        step(model2, opt2, 9)
        assert ckpt.save(9).version == 9  # numbered above every tier's versions
        ckpt.wait()


def test_a_failing_replica_blocks_nothing_and_loses_nothing(shm_dir: Path, tmp_path: Path) -> None:
    disk, gone = tmp_path / "disk", tmp_path / "unplugged"
    model, opt = model_and_optimizer()
    placement = P.MemoryThenDisk(memory_keep=1, disk_keep=2, disk_every=1)
    with _checkpointer(shm_dir, disk, model, opt, placement=placement, retries=50) as ckpt:
        for s in (1, 2):
            step(model, opt, s)
            ckpt.save(s).wait()
            assert ckpt.tiers.wait_idle(30)
        os.rename(disk, gone)  # the disk goes away under the running job
        for s in (3, 4, 5):
            step(model, opt, s)
            assert ckpt.save(s).wait(timeout=30) == "committed"  # training goes on
        status = ckpt.tiers.status()["local"]
        assert status.failures >= 1 and "version" in status.last_error
        # The primary keeps what the replica still has to copy, whatever its keep_last says.
        waiting = {status.in_flight, status.pending} - {None}
        assert waiting and waiting <= set(CheckpointDir(shm_dir).committed_versions())
        assert CheckpointDir(gone).committed_versions() == [1, 2]  # nothing deleted meanwhile
        os.rename(gone, disk)  # back: the newest version is copied, the older ones skipped
        step(model, opt, 6)
        ckpt.save(6).wait()
        assert ckpt.tiers.wait_idle(30)
        final = ckpt.tiers.status()["local"]
        assert final.last_written == 6 and final.skipped >= 1
    kept = CheckpointDir(disk).committed_versions()
    assert len(kept) == 2 and kept[-1] == 6
    for version in kept:
        load_version(disk / f"v{version:08d}")  # complete and verified


def test_restore_falls_back_tier_by_tier_before_version_by_version(
    shm_dir: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    model, opt = model_and_optimizer()
    placement = P.MemoryThenDisk(memory_keep=2, disk_keep=2, disk_every=1)
    states = {}
    with _checkpointer(shm_dir, disk, model, opt, placement=placement) as ckpt:
        for s in (1, 2):
            step(model, opt, s)
            ckpt.save(s).wait()
            assert ckpt.tiers.wait_idle(30)
            states[s] = snapshot(model)

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    flip(shm_dir / "v00000002" / "data.bin")
    model2, opt2 = model_and_optimizer(seed=1)
    with _checkpointer(shm_dir, disk, model2, opt2, placement=placement) as ckpt:
        assert ckpt.restore() == 2  # same version, from the disk tier
        report = ckpt.last_restore
        assert report.tier == "local" and report.version == 2
        assert report.skipped[0][0] == 2 and "memory" in report.skipped[0][1]
        assert same(snapshot(model2), states[2])
    flip(disk / "v00000002" / "data.bin")
    model3, opt3 = model_and_optimizer(seed=2)
    with _checkpointer(shm_dir, disk, model3, opt3, placement=placement) as ckpt:
        assert ckpt.restore() == 1  # v2 is bad everywhere: the next older version
        assert same(snapshot(model3), states[1])


def test_sigkill_while_copying_to_the_replica_leaves_nothing_listed(
    tmp_path: Path, python: str, child_env: dict[str, str]
) -> None:
    primary, disk = tmp_path / "primary", tmp_path / "disk"
    child = textwrap.dedent(
        f"""
        import torch
        from pcframe import Checkpointer
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Checkpointer({str(primary)!r}, model=model, optimizer=opt,
                          tiers={{"disk": {str(disk)!r}}}) as ckpt:
            for s in range(1, 6):
                opt.step()
                ckpt.save(s).wait()
                assert ckpt.tiers.wait_idle(30)
        """
    )
    env = {**child_env, "PCFRAME_CRASH_AT": "replica_copied:3"}
    proc = subprocess.run([python, "-c", child], env=env, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr  # killed itself right before publishing v3
    assert CheckpointDir(disk).committed_versions() == [1, 2]
    assert (disk / "v00000003.tmp").is_dir()  # the copy was really under way
    assert 3 in CheckpointDir(primary).committed_versions()
    tier = LocalTier(disk)  # the next writer cleans up
    try:
        assert tier.removed_leftovers == ["v00000003.tmp"]
        assert tier.committed_versions() == [1, 2]
    finally:
        tier.close()


def test_configuration_errors_name_the_tier_and_the_fix(tmp_path: Path) -> None:
    model, _ = model_and_optimizer()
    with pytest.raises(TierError, match=r"tier\(s\) \['remote'\].*pass tiers=\{'remote'"):
        Checkpointer(tmp_path / "a", model=model, placement=P.LocalPlusRemote())
    with pytest.raises(TierError, match="is the Checkpointer's own directory"):
        Checkpointer(tmp_path / "a", model=model, tiers={"primary": tmp_path / "a"})
    with pytest.raises(TierError, match=r"never writes there"):
        Checkpointer(
            tmp_path / "a", model=model, tiers={"disk": tmp_path / "b"}, placement=P.SingleTier()
        )
    with pytest.raises(TierError, match=r"tiers\.x: int is not a tier"):
        Tiers({"x": 3})  # type: ignore[dict-item]
    with pytest.raises(TierError, match="not a RAM-backed file system"):
        memory_directory("run", base=tmp_path)
    # a failed construction released the directory lock: a corrected one can open it
    first = Checkpointer(tmp_path / "a", model=model, tiers={"disk": tmp_path / "b"})
    # one writer per replica directory, as for the primary
    with pytest.raises(
        TierError, match=r"tier 'disk' at .*b: .*already has a Checkpointer open in this process"
    ):
        Checkpointer(tmp_path / "c", model=model, tiers={"disk": tmp_path / "b"})
    first.close()
    Checkpointer(tmp_path / "c", model=model, tiers={"disk": tmp_path / "b"}).close()


def test_a_tier_listed_later_is_not_listed_at_open_and_never_written_over(
    shm_dir: Path, tmp_path: Path
) -> None:
    """``Tiers.list_later``: the engine does not list that tier when it opens, so it numbers
    from its own directory alone (the opener, a multi-rank job's rank 0, numbers above the
    tier); the tier's worker still lists it before writing and refuses to write a version
    at or below one the tier holds."""
    disk = tmp_path / "disk"
    model, opt = model_and_optimizer()
    with Checkpointer(
        tmp_path / "first", model=model, optimizer=opt, tiers=Tiers({"local": disk})
    ) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s).wait()
        assert ckpt.tiers.wait_idle(30)
    assert CheckpointDir(disk).committed_versions()[-1] == 3

    later = Tiers({"local": disk}, backoff=0.05, backoff_max=0.1, retries=0)
    later.list_later("local")
    with Checkpointer(shm_dir, model=model, optimizer=opt, tiers=later) as ckpt:
        assert ckpt.next_version == 1  # the tier's versions are the opener's to number above
        ckpt.save(4).wait()
        ckpt.tiers.wait_idle(30)
        status = ckpt.tiers.status()["local"]
        assert status.written == 0 and "already holds version 3" in status.last_error
    assert CheckpointDir(disk).committed_versions()[-1] == 3  # nothing written over
    with pytest.raises(TierError, match="no such replica tier"):
        Tiers({"local": disk}).list_later("remote")

    with Checkpointer(
        tmp_path / "third", model=model, optimizer=opt, tiers=Tiers({"local": disk})
    ) as ckpt:
        assert ckpt.next_version == 4  # listed at open: numbered above the tier


def test_a_stray_file_named_like_a_version_in_a_replica_fails_that_write_by_name(tmp_path):
    """The rename landed on it: a raw NotADirectoryError in the tier's status."""
    (tmp_path / "replica").mkdir()
    (tmp_path / "replica" / "v00000001").write_text("the user's")
    model, _ = model_and_optimizer()
    tiers = Tiers({"disk": tmp_path / "replica"}, retries=0, backoff=0.05)
    with Checkpointer(tmp_path / "primary", model=model, tiers=tiers) as ckpt:
        ckpt.save(1).wait()
        ckpt.tiers.wait_idle(30)
        status = ckpt.tiers.status()["disk"]
    assert status.abandoned == 1 and "exists and is not a version" in status.last_error
    assert (tmp_path / "replica" / "v00000001").read_text() == "the user's"


def _one_version(root: Path) -> Path:
    """A committed version of a small model's state in ``root`` (its folder)."""
    model, optimizer = model_and_optimizer()
    step(model, optimizer, seed=0)
    with Checkpointer(root, model=model, optimizer=optimizer, chunk_bytes=64 << 10) as ckpt:
        ckpt.save(step=1).wait()
    return root / "v00000001"


def test_a_copy_of_a_damaged_source_is_refused_before_it_counts(tmp_path: Path) -> None:
    """A byte of a memory tier's version damaged after its commit: the replica copied it and
    said written, and retention then deleted the older good copies for it (nothing left to
    restore once the VM went). The copy is checked piece by piece before it is published."""
    from pcframe.errors import CorruptCheckpoint

    source = _one_version(tmp_path / "memory")
    data = next(p for p in sorted(source.iterdir()) if p.name.startswith("data"))
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    tier = LocalTier(tmp_path / "disk")
    with pytest.raises(CorruptCheckpoint, match=rf"{data.name}: checksum mismatch at byte 0"):
        tier.write(1, source)
    assert tier.committed_versions() == []
    assert not any((tmp_path / "disk").glob("v*"))  # the staged copy is gone too


def test_a_copy_falling_back_part_way_writes_each_piece_at_its_offset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copy_file_range failing after earlier pieces (EINTR, EXDEV on some file systems): the
    plain copy wrote at the file's own position, 0, and the replica held scrambled bytes."""
    import pcframe.store.tiers.local as local

    source = _one_version(tmp_path / "memory")
    monkeypatch.setattr(local, "_PIECE", 16 << 10)  # several pieces per file
    real, calls = os.copy_file_range, []

    def flaky(*args):
        calls.append(args)
        if len(calls) == 3:
            raise InterruptedError(4, "Interrupted system call")
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", flaky)
    tier = LocalTier(tmp_path / "disk")
    tier.write(1, source)
    copied = tmp_path / "disk" / "v00000001"
    for path in source.iterdir():
        assert (copied / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_memory_folder_whose_link_lost_its_target_says_so(tmp_path: Path) -> None:
    """A memory folder reached through a link (run/mem -> /dev/shm/...) after a reboot
    wiped /dev/shm: the open said 'File exists ... fix its permissions'."""
    from pcframe import CheckpointError

    link = tmp_path / "mem"
    link.symlink_to(tmp_path / "gone" / "run")
    with pytest.raises(CheckpointError, match=r"is a link to .*gone/run, which does not exist"):
        Checkpointer(link)


def test_a_ram_backed_tier_said_to_survive_the_vm_is_warned_about(
    shm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = model_and_optimizer()
    with Checkpointer(
        tmp_path / "disk",
        model=model,
        optimizer=optimizer,
        tiers=Tiers({"local": shm_dir}),  # a "disk" tier on tmpfs, its rule: it survives
        placement=P.TieredPlacement([P.TierRule("disk", 1, 2), P.TierRule("local", 1, 2)]),
    ):
        pass
    assert any("is RAM-backed" in r.getMessage() for r in caplog.records), caplog.records


def test_a_full_disk_tier_makes_room_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A disk tier with room for exactly the versions it keeps: retention ran only after a
    successful write, so every later version failed with a bare ENOSPC and the tier stayed
    at its old versions for good (after the VM, the job restored those). The older versions
    that retention drops are deleted first, and the tier keeps up."""
    import errno

    real = LocalTier.write

    def room_for_two(tier: LocalTier, version: int, source: Path, step=None) -> int:
        if len(tier.committed_versions()) >= 2:  # the device is full
            raise OSError(errno.ENOSPC, "No space left on device", str(tier.path))
        return real(tier, version, source, step)

    monkeypatch.setattr(LocalTier, "write", room_for_two)
    disk = tmp_path / "disk"
    model, optimizer = model_and_optimizer()
    with Checkpointer(
        tmp_path / "primary",
        model=model,
        optimizer=optimizer,
        tiers=Tiers({"local": disk}, backoff=0.01),
        keep_last=2,
    ) as ckpt:
        for s in range(1, 6):
            step(model, optimizer, seed=s)
            ckpt.save(step=s).wait()
            assert ckpt.tiers.wait_idle(30)
    assert CheckpointDir(disk).committed_versions() == [4, 5]
    assert any("is full" in r.getMessage() for r in caplog.records)
