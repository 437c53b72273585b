"""I/O errors under the reader and the writer: nothing good is lost, nothing is hidden.

Reads: an ``OSError`` (EIO, EMFILE, ENOMEM, EINTR) is not corruption. It is retried with
backoff; if it persists, restore raises ``RestoreIOError`` naming file and errno, renames
nothing, and a later healthy restore finds the newest version. Writes: ENOSPC at any write
or sync fails that one save with a clear ``SaveError``; the last committed version survives,
and the engine commits again once the disk has room.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from pcframe import Checkpointer, RestoreIOError, SaveError
from pcframe.store.directory import CheckpointDir
from tests.faults.inject import EINTR, EIO, EMFILE, ENOMEM, ENOSPC, inject, short_reads
from tests.helpers import small_training, state_equal, train_steps


def three_versions(root) -> dict:
    """Commit versions 1..3 of a small training run; return the state of version 3."""
    model, optimizer, scheduler = small_training()
    with Checkpointer(root, model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        for step in (1, 2, 3):
            train_steps(model, optimizer, scheduler, 1, seed=step)
            ckpt.save(step).wait()
    return {k: v.clone() for k, v in model.state_dict().items()}


def listing(root) -> list[str]:
    return sorted(os.listdir(root))


@pytest.mark.parametrize("code", [EIO, EMFILE, ENOMEM, EINTR])
def test_transient_read_errors_are_retried_not_quarantined(tmp_path, monkeypatch, code):
    expected = three_versions(tmp_path)
    fault = inject(monkeypatch, "preadv", code, nth=1, times=2)  # two failures, then fine
    model, optimizer, scheduler = small_training(seed=9)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        assert ckpt.restore() == 3
        assert ckpt.last_restore.skipped == []
    assert fault.failed == 2
    assert state_equal(model.state_dict(), expected)
    assert not [n for n in listing(tmp_path) if n.startswith(".corrupt")]


@pytest.mark.parametrize(("call", "code"), [("preadv", EIO), ("open", EMFILE), ("preadv", ENOMEM)])
def test_persistent_read_errors_raise_and_rename_nothing(tmp_path, monkeypatch, call, code):
    three_versions(tmp_path)
    before = listing(tmp_path)
    with monkeypatch.context() as patch:
        when = None
        if call == "open":
            data = str(tmp_path)
            when = lambda path, *a, **k: str(path).startswith(data) and "v0" in str(path)  # noqa: E731
        inject(patch, call, code, nth=1, times=10**6, when=when)
        model, optimizer, scheduler = small_training(seed=9)
        untouched = {k: v.clone() for k, v in model.state_dict().items()}
        with (
            Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) as c,
            pytest.raises(RestoreIOError) as caught,
        ):
            c.restore()
    message = str(caught.value)
    assert "version 3" in message and os.strerror(code) in message
    assert ("data.bin" in message) or ("manifest.json" in message) or ("v00000003" in message)
    versions = [n for n in listing(tmp_path) if n.startswith("v")]
    assert versions == [n for n in before if n.startswith("v")]  # nothing renamed or removed
    assert not [n for n in listing(tmp_path) if n.startswith(".corrupt")]
    assert state_equal(model.state_dict(), untouched)  # a failed restore changed nothing
    # The storage heals: the next run restores the newest version.
    model, optimizer, scheduler = small_training(seed=9)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) as c:
        assert c.restore() == 3


def test_short_reads_restore_bit_exact(tmp_path, monkeypatch):
    expected = three_versions(tmp_path)
    short_reads(monkeypatch, most=1000)
    model, optimizer, scheduler = small_training(seed=9)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        assert ckpt.restore() == 3
    assert state_equal(model.state_dict(), expected)


@pytest.mark.parametrize("call", ["pwrite", "fdatasync", "fsync", "posix_fallocate"])
@pytest.mark.parametrize("nth", [1, 2, 4])
def test_enospc_at_any_write_or_sync_keeps_the_last_version(tmp_path, monkeypatch, call, nth):
    model, optimizer, scheduler = small_training()
    with Checkpointer(
        tmp_path,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        chunk_bytes=4096,
        o_direct="off",
    ) as ckpt:
        train_steps(model, optimizer, scheduler, 1)
        ckpt.save(1).wait()
        good = {k: v.clone() for k, v in model.state_dict().items()}
        train_steps(model, optimizer, scheduler, 1)
        with monkeypatch.context() as patch:
            fault = inject(patch, call, ENOSPC, nth=nth, times=1)
            handle = ckpt.save(2)
            try:
                status = handle.wait()
            except SaveError as exc:
                status = "failed"
                assert "no space left on device" in str(exc), exc
        if nth == 1:
            assert fault.failed == 1, f"{call} was never called by a save"
        if fault.failed:
            # Either the fault hit a commit-critical call (the save failed cleanly) or LATEST,
            # which lags with a warning while the version is committed.
            assert status in ("failed", "committed")
        assert 1 in CheckpointDir(tmp_path).committed_versions() or status == "committed"
        train_steps(model, optimizer, scheduler, 1)
        assert ckpt.save(3).wait() == "committed"  # the disk has room again
    assert not [n for n in listing(tmp_path) if n.endswith(".tmp")]
    model2, optimizer2, scheduler2 = small_training(seed=5)
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2, scheduler=scheduler2) as c:
        assert c.restore(1) == 1
    assert state_equal(model2.state_dict(), good)


def test_latest_write_failure_after_commit_reports_committed(tmp_path, monkeypatch, caplog):
    model = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path, model=model, keep_last=1) as ckpt:
        ckpt.save(1).wait()
        original = os.replace

        def replace(src, dst, *a, **k):
            if os.path.basename(dst) == "LATEST":
                raise OSError(ENOSPC, os.strerror(ENOSPC), str(dst))
            return original(src, dst, *a, **k)

        monkeypatch.setattr(os, "replace", replace)
        with caplog.at_level(logging.WARNING, logger="pcframe"):
            assert ckpt.save(2).wait() == "committed"
        monkeypatch.setattr(os, "replace", original)
        ckpt.wait()  # records are updated at the next engine call
        assert ckpt.records[2].status == "committed"
    assert "LATEST could not be updated" in caplog.text
    directory = CheckpointDir(tmp_path)
    assert directory.committed_versions() == [2]  # retention still ran (keep_last=1)
    assert directory.latest_hint() == 1  # lags, and the listing decides
    with Checkpointer(tmp_path, model=torch.nn.Linear(4, 4)) as ckpt:
        assert ckpt.restore() == 2


FILE_SIZE_LIMITED_SAVE = """
import resource, sys, torch
from pcframe import Checkpointer, SaveError
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
model = torch.nn.Linear(1024, 256)  # 1 MiB of weights: over the limit
with Checkpointer(sys.argv[1], model=model, o_direct="off") as ckpt:
    try:
        ckpt.save(1).wait()
    except SaveError as exc:
        print(exc)
"""


def test_a_file_size_limit_is_named_with_its_fix(tmp_path, python, child_env):
    """A real RLIMIT_FSIZE (EFBIG; Python ignores SIGXFSZ): the error named neither the file
    nor the limit ("OSError: [Errno 27] File too large")."""
    import subprocess

    run = subprocess.run(
        [python, "-c", FILE_SIZE_LIMITED_SAVE, str(tmp_path / "ckpt")],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "than the file size limit (ulimit -f) allows; raise the limit" in run.stdout, run.stdout
