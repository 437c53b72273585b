"""The remote tier under real failures: a server SIGKILLed or stalled in the middle of an
upload, and an uploader SIGKILLed between its data and its commit marker.

Properties: nothing half-uploaded is ever listed as a version (every listed version downloads
and verifies), local commits never wait for the remote, and the next upload succeeds.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pcframe.policies as P
from pcframe import Checkpointer
from pcframe.restore.reader import load_version
from pcframe.store.tiers import RemoteTier, TierError, Tiers
from tests.store.tiers.conftest import MotoServer
from tests.store.tiers.helpers import same, snapshot

PART = 5 * 1024 * 1024  # the smallest multipart part S3 accepts: uploads take several requests


def big_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # 4 MiB of weights + 8 MiB of Adam moments: a 12 MiB data file, three multipart parts
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 1024)).square().mean().backward()
    opt.step()


def remote(server: MotoServer, bucket: str, **kw) -> RemoteTier:
    tier = RemoteTier(
        f"s3://{bucket}/run",
        server.storage_options(),
        upload_options={"chunksize": PART, "max_concurrency": 1},
        **kw,
    )
    tier.name = "remote"
    return tier


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def assert_only_complete_versions_listed(server: MotoServer, bucket: str, scratch: Path) -> list:
    """Every listed version is complete and verifies; everything else is unlisted garbage."""
    tier = remote(server, bucket, timeout=10)
    listed = tier.committed_versions()
    for version in listed:
        with tier.fetch(version, scratch / f"check-{version}") as path:
            assert load_version(path).manifest.version == version
    return listed


@contextlib.contextmanager
def uploading_every_version(tmp_path: Path, model, opt, tiers: Tiers, **keep) -> Iterator:
    """A Checkpointer uploading every version (``keep``: the placement's retention) with
    version 1 trained, saved and in the object store."""
    placement = P.LocalPlusRemote(remote_every=1, **keep)
    with Checkpointer(
        tmp_path / "local", model=model, optimizer=opt, tiers=tiers, placement=placement
    ) as ckpt:
        train(model, opt)
        ckpt.save(1).wait()
        assert ckpt.tiers.wait_idle(60)
        yield ckpt


def start_upload_and_wait_for_first_part(ckpt, model, opt, server, bucket, version) -> None:
    train(model, opt)
    ckpt.save(version)
    key = f"run/v{version:08d}/data.bin"
    wait_until(lambda: server.parts_in_flight(bucket).get(key, 0) >= 1, 60, f"a part of {key}")


@pytest.mark.slow
def test_server_sigkilled_mid_upload(own_moto_server: MotoServer, bucket: str, tmp_path: Path):
    server = own_moto_server
    model, opt = big_model()
    tiers = Tiers(
        {"remote": remote(server, bucket, timeout=5)}, retries=1000, backoff=0.1, backoff_max=0.5
    )
    placement = P.LocalPlusRemote(remote_every=1, local_keep=2, remote_keep=2)
    with uploading_every_version(tmp_path, model, opt, tiers, local_keep=2, remote_keep=2) as ckpt:
        start_upload_and_wait_for_first_part(ckpt, model, opt, server, bucket, 2)
        server.pause()  # freeze it right there, mid-upload (parts of v2 received, no marker)
        server.kill()
        for s in (3, 4):  # training and local commits go on at local speed
            train(model, opt)
            # Committed within the wait: a save that waited for the dead upload would not be
            # (the tier retries for minutes); no wall-time bound (this machine may be busy).
            assert ckpt.save(s).wait(timeout=30) == "committed"
        wait_until(lambda: ckpt.tiers.status()["remote"].failures >= 1, 60, "a failed attempt")
        assert ckpt.tiers.status()["remote"].last_written == 1
        server.start()  # a fresh, empty server on the same port (the bucket is recreated)
        train(model, opt)
        ckpt.save(5).wait()
        assert ckpt.tiers.wait_idle(120)
        assert ckpt.tiers.status()["remote"].last_written == 5
        expected = snapshot(model)
    listed = assert_only_complete_versions_listed(server, bucket, tmp_path)
    assert listed[-1] == 5
    assert {k.split("/")[1] for k in server.keys(bucket)} == {f"v{v:08d}" for v in listed}
    # and the upload is a real checkpoint: a new machine restores it
    model2, opt2 = big_model()
    train(model2, opt2)
    with Checkpointer(
        tmp_path / "new",
        model=model2,
        optimizer=opt2,
        tiers={"remote": remote(server, bucket, timeout=10)},
        placement=placement,
    ) as ckpt:
        assert ckpt.restore() == 5 and ckpt.last_restore.tier == "remote"
        assert same(snapshot(model2), expected)


@pytest.mark.slow
def test_stalled_server_times_out_skips_to_the_newest_and_recovers(
    own_moto_server: MotoServer, bucket: str, tmp_path: Path
):
    server = own_moto_server
    model, opt = big_model()
    # 1 s per small request, 12 MiB at >= 32 MiB/s: a stalled transfer is abandoned in ~1.4 s
    tier = remote(server, bucket, timeout=1.0, min_throughput=32 * 1024 * 1024)
    tiers = Tiers({"remote": tier}, retries=1000, backoff=0.1, backoff_max=0.5)
    with uploading_every_version(tmp_path, model, opt, tiers, local_keep=2, remote_keep=2) as ckpt:
        start_upload_and_wait_for_first_part(ckpt, model, opt, server, bucket, 2)
        server.pause()
        try:
            for s in (3, 4):
                train(model, opt)
                # the stalled upload blocks nothing (it would for as long as the server stalls)
                assert ckpt.save(s).wait(timeout=30) == "committed"
            wait_until(lambda: ckpt.tiers.status()["remote"].failures >= 1, 30, "a timeout")
            status = ckpt.tiers.status()["remote"]
            assert "did not finish within" in status.last_error
            assert status.lag_versions >= 3 and status.lag_seconds > 0.0  # lag is reported
            # Resume only once no attempt at v2 or v3 is in flight (a stalled one would
            # complete when the server wakes).
            newest = lambda: ckpt.tiers.status()["remote"].in_flight in (None, 4)  # noqa: E731
            wait_until(newest, 60, "the replicator on the newest version")
        finally:
            server.resume()
        assert ckpt.tiers.wait_idle(120)
        status = ckpt.tiers.status()["remote"]
        assert status.last_written == 4 and status.skipped >= 1  # intermediate ones dropped
    listed = assert_only_complete_versions_listed(server, bucket, tmp_path)
    # v3 was saved while the server was stopped: its upload stalled or was superseded, never
    # completed. v2 is listed only when its upload had finished before SIGSTOP landed (the
    # test saw its first part, but a loaded machine may let the rest through first).
    assert listed[-1] == 4 and 3 not in listed
    remote(server, bucket).sweep()  # a late request the stalled server finished is garbage
    assert {k.split("/")[1] for k in server.keys(bucket)} == {f"v{v:08d}" for v in listed}


UPLOADER = """
import sys, torch
import pcframe.policies as P
from pcframe import Checkpointer
from pcframe.store.tiers import RemoteTier, TierError, Tiers

endpoint, bucket, local = sys.argv[1:4]
options = {{"key": "testing", "secret": "testing", "client_kwargs": {{"endpoint_url": endpoint}}}}
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
tiers = Tiers({{"remote": RemoteTier(f"s3://{{bucket}}/run", options)}})
placement = P.LocalPlusRemote(remote_every=1, local_keep=2, remote_keep=2)
with Checkpointer(local, model=model, optimizer=opt, tiers=tiers, placement=placement) as ckpt:
    start = ckpt.restore() or 0
    for s in range(start + 1, start + {steps}):
        with torch.no_grad():
            model.weight.fill_(float(s))
        ckpt.save(s).wait()
        assert ckpt.tiers.wait_idle(60)
"""


def run_uploader(python, env, server, bucket, local, crash_at=None, steps=4):
    env = dict(env)
    if crash_at:
        env["PCFRAME_CRASH_AT"] = crash_at
    script = textwrap.dedent(UPLOADER.format(steps=steps))
    proc = subprocess.run(
        [python, "-c", script, server.endpoint, bucket, str(local)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc


@pytest.mark.slow
def test_uploader_sigkilled_before_its_marker_and_while_deleting(
    moto_server: MotoServer, bucket: str, tmp_path: Path, python: str, child_env: dict
):
    local = tmp_path / "local"
    # 1) killed right after v2's data file is uploaded, before its manifest and marker
    proc = run_uploader(python, child_env, moto_server, bucket, local, "remote_file_uploaded:3")
    assert proc.returncode == -9, proc.stderr
    keys = moto_server.keys(bucket)
    assert "run/v00000002/data.bin" in keys and "run/v00000002/COMMITTED" not in keys
    assert assert_only_complete_versions_listed(moto_server, bucket, tmp_path) == [1]

    # 2) resumed (from its local v2), uploads v3 and v4 (sweeping v2's leftovers), and is
    #    killed by retention after deleting v1's marker but before v1's data
    proc = run_uploader(python, child_env, moto_server, bucket, local, "remote_marker_deleted:1")
    assert proc.returncode == -9, proc.stderr
    keys = moto_server.keys(bucket)
    assert not [k for k in keys if "/v00000002/" in k]  # swept by the next writer
    assert "run/v00000001/data.bin" in keys and "run/v00000001/COMMITTED" not in keys
    assert assert_only_complete_versions_listed(moto_server, bucket, tmp_path) == [3, 4]

    # 3) a clean run: the next uploads succeed and leave nothing behind
    proc = run_uploader(python, child_env, moto_server, bucket, local)
    assert proc.returncode == 0, proc.stderr
    listed = assert_only_complete_versions_listed(moto_server, bucket, tmp_path)
    assert listed == [6, 7]
    assert {k.split("/")[1] for k in moto_server.keys(bucket)} == {"v00000006", "v00000007"}
    shutil.rmtree(local)
    tier = remote(moto_server, bucket)
    with tier.fetch(7, tmp_path / "final") as path:
        loaded = load_version(path)
        assert loaded.manifest.step == 7
        weight = loaded.named_tensors()["model/weight"]
        assert torch.equal(weight, torch.full_like(weight, 7.0))


@pytest.mark.slow
def test_notice_aborts_an_older_stuck_upload_and_secures_the_emergency_version(
    own_moto_server: MotoServer, bucket: str, tmp_path: Path
):
    import threading

    server = own_moto_server
    model, opt = big_model()
    source = P.ManualNoticeSource()
    # A stuck transfer would only be given up after 60 s: far beyond the 20 s notice.
    tier = remote(server, bucket, timeout=60.0, min_throughput=1e9)
    with Checkpointer(
        tmp_path / "local",
        model=model,
        optimizer=opt,
        policy=P.NoticeDriven(P.FixedSteps(1000), save_time_prior=1.0, margin=1.0),
        tiers=Tiers({"remote": tier}, backoff=0.1),
        # the local disk is instance storage: it dies with the VM, only the bucket survives
        placement=P.LocalPlusRemote(remote_every=1, local_survives_preemption=False),
        notices=[source],
    ) as ckpt:
        start_upload_and_wait_for_first_part(ckpt, model, opt, server, bucket, 1)
        server.pause()  # v1's upload is stuck mid-way
        threading.Timer(1.0, server.resume).start()  # the server recovers a moment later
        train(model, opt)
        source.trigger(time.monotonic(), window=20.0)
        started = time.monotonic()
        handle = ckpt.maybe_save(2)
        took = time.monotonic() - started
        secured = ckpt.last_secured
        assert handle is not None and handle.version == 2
        assert secured.tiers == ("remote",) and secured.durable, secured
        assert took < 20.0  # v1 was aborted, not waited for
        status = ckpt.tiers.status()["remote"]
        assert status.skipped >= 1 and status.last_written == 2
    assert assert_only_complete_versions_listed(server, bucket, tmp_path) == [2]


@pytest.mark.slow
def test_a_server_gone_between_listing_and_download_is_a_tier_error(
    own_moto_server: MotoServer, bucket: str, tmp_path: Path
):
    """botocore's connection errors are not OSError: one raised by the marker's or a file's
    download escaped the restore as a raw EndpointConnectionError."""
    server = own_moto_server
    model, opt = big_model()
    tiers = Tiers({"remote": remote(server, bucket, timeout=5)}, backoff=0.05, backoff_max=0.2)
    with uploading_every_version(tmp_path, model, opt, tiers):
        pass
    # The listing runs while the server is up: on a busy machine it took more than 3 s. Once
    # the server is gone every request is refused at once; the timeout bounds nothing there.
    tier = remote(server, bucket, timeout=30)
    assert tier.committed_versions() == [1]
    server.kill()
    with pytest.raises(TierError, match=r"tier 'remote' .*cannot read .*v00000001/COMMITTED"):
        tier.read_marker(1)
    with pytest.raises(TierError, match=r"cannot read"), tier.fetch(1, tmp_path / "scratch"):
        pass


def test_a_notice_never_uploads_a_version_twice(
    moto_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    """Every version is uploaded; a notice's emergency version, which the routine placement
    queued too, is uploaded once. A second upload first removed the copy the notice had just
    secured, and the close in a hurry after the notice cut it off: a new machine found no
    version at all (found by a red team: ``restore()`` returned None)."""
    model, opt = big_model()
    source = P.ManualNoticeSource(window=60.0)
    tiers = Tiers({"remote": remote(moto_server, bucket, timeout=10)}, backoff=0.05)
    with Checkpointer(
        tmp_path / "local",
        model=model,
        optimizer=opt,
        policy=P.NoticeDriven(P.FixedSteps(1000), save_time_prior=0.5, margin=1.0),
        tiers=tiers,
        placement=P.LocalPlusRemote(remote_every=1, local_keep=2, remote_keep=1),
        notices=[source],
    ) as ckpt:
        for s in (1, 2):
            train(model, opt)
            ckpt.save(s).wait()
            assert ckpt.tiers.wait_idle(60)
        train(model, opt)
        source.trigger(time.monotonic())
        assert ckpt.maybe_save(3).version == 3 and ckpt.last_secured.durable
        assert ckpt.tiers.wait_idle(60)
        status = ckpt.tiers.status()["remote"]
        assert (status.written, status.failures) == (3, 0)
        expected = snapshot(model)
    model2, opt2 = big_model()
    with Checkpointer(
        tmp_path / "new",
        model=model2,
        optimizer=opt2,
        tiers={"remote": remote(moto_server, bucket, timeout=10)},
        placement=P.LocalPlusRemote(remote_every=1),
    ) as ckpt:
        assert ckpt.restore() == 3 and ckpt.last_restore.tier == "remote"
        assert same(snapshot(model2), expected)
