"""Local plus an s3:// tier on a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest

import pcframe.policies as P
from pcframe import Checkpointer
from pcframe.errors import CheckpointError, RestoreIOError
from pcframe.format.manifest import MANIFEST_NAME, manifest_crc, read_manifest
from pcframe.store.directory import CheckpointDir, WritableCheckpointDir
from pcframe.store.tiers import RemoteTier, TierError, Tiers
from tests.store.tiers.conftest import MotoServer
from tests.store.tiers.helpers import model_and_optimizer, same, snapshot, step


def remote(server: MotoServer, bucket: str, **kw) -> RemoteTier:
    return RemoteTier(f"s3://{bucket}/run", server.storage_options(), timeout=10, **kw)


def checkpointer(directory: Path, server: MotoServer, bucket: str, model, opt) -> Checkpointer:
    return Checkpointer(
        directory,
        model=model,
        optimizer=opt,
        tiers=Tiers({"remote": remote(server, bucket)}, backoff=0.05, backoff_max=0.2),
        placement=P.LocalPlusRemote(remote_every=2, local_keep=2, remote_keep=2),
        keep_last=2,
        chunk_bytes=8192,
    )


def train_and_save(ckpt: Checkpointer, model, opt, steps: range, states: dict) -> None:
    for s in steps:
        step(model, opt, s)
        ckpt.save(s).wait()
        assert ckpt.tiers.wait_idle(60)
        states[s] = snapshot(model)


def uploaded_six(local: Path, server: MotoServer, bucket: str) -> dict:
    """Versions 1-6 saved, 4 and 6 in the bucket; the states by step."""
    model, opt = model_and_optimizer()
    states: dict = {}
    with checkpointer(local, server, bucket, model, opt) as ckpt:
        train_and_save(ckpt, model, opt, range(1, 7), states)
    return states


def test_every_kth_version_uploaded_marker_last_and_restored_after_losing_the_machine(
    moto_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    model, opt = model_and_optimizer()
    states: dict = {}
    with checkpointer(local, moto_server, bucket, model, opt) as ckpt:
        train_and_save(ckpt, model, opt, range(1, 7), states)
        status = ckpt.tiers.status()["remote"]
        assert status.written == 3 and status.failures == 0 and status.lag_versions == 0
    keys = moto_server.keys(bucket)
    # every 2nd version uploaded, the remote keeps 2; exactly data, manifest and marker each
    assert keys == [
        f"run/v0000000{v}/{name}"
        for v in (4, 6)
        for name in ("COMMITTED", "data.bin", "manifest.json")
    ]
    s3 = moto_server.client()
    marker = json.loads(s3.get_object(Bucket=bucket, Key="run/v00000006/COMMITTED")["Body"].read())
    assert marker["version"] == 6 and marker["step"] == 6
    assert marker["files"]["data.bin"] == (local / "v00000006" / "data.bin").stat().st_size
    assert remote(moto_server, bucket).committed_versions() == [4, 6]

    shutil.rmtree(local)  # the VM and its disk are gone; only the bucket is left
    model2, opt2 = model_and_optimizer(seed=1)
    with checkpointer(local, moto_server, bucket, model2, opt2) as ckpt:
        assert ckpt.restore() == 6
        assert ckpt.last_restore.tier == "remote"
        assert same(snapshot(model2), states[6])
        assert not list(local.glob(".fetch-*"))  # the download area is cleaned up
        train_and_save(ckpt, model2, opt2, range(7, 9), states)  # numbered 7, 8 (above 6)
    assert remote(moto_server, bucket).committed_versions() == [6, 8]


def test_listing_shows_only_marked_versions_and_the_writer_sweeps_the_rest(
    moto_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    tier = remote(moto_server, bucket)
    tier.name = "remote"
    source = tmp_path / "v"
    source.mkdir()
    (source / "data.bin").write_bytes(b"x" * 1000)
    (source / "manifest.json").write_bytes(b"{}")
    for version in (2, 5):
        tier.write(version, source, step=version)
    s3 = moto_server.client()
    # leftovers of uploads that died before their marker: one older, one newer than v5
    s3.put_object(Bucket=bucket, Key="run/v00000003/data.bin", Body=b"half")
    s3.put_object(Bucket=bucket, Key="run/v00000009/data.bin", Body=b"half")
    assert tier.committed_versions() == [2, 5]
    assert tier.sweep() == ["v00000003"]  # v9 may still be in progress: left alone
    assert "run/v00000003/data.bin" not in moto_server.keys(bucket)
    tier.delete(5)
    assert tier.committed_versions() == [2]
    assert not [k for k in moto_server.keys(bucket) if "/v00000005/" in k]
    # Objects someone else put under a version, named with glob characters: each deleted by
    # its own name, never expanded into a pattern over the bucket (run/v00000002/* would
    # also have matched the version's own files and, with a prefix pattern, other runs').
    s3.put_object(Bucket=bucket, Key="run/v00000002/x[1]", Body=b"junk")
    s3.put_object(Bucket=bucket, Key="run/v00000002/*", Body=b"junk")
    s3.put_object(Bucket=bucket, Key="runA/v00000002/data.bin", Body=b"another run")
    tier.delete(2)
    assert sorted(moto_server.keys(bucket)) == ["run/v00000009/data.bin", "runA/v00000002/data.bin"]


def test_a_corrupt_remote_version_is_skipped_for_an_older_one(
    moto_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    states = uploaded_six(local, moto_server, bucket)
    s3 = moto_server.client()
    key = "run/v00000006/data.bin"
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[100] ^= 0xFF  # same size, one flipped bit in the object store
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    shutil.rmtree(local)
    model2, opt2 = model_and_optimizer(seed=1)
    with checkpointer(local, moto_server, bucket, model2, opt2) as ckpt:
        assert ckpt.restore() == 4
        version, reason = ckpt.last_restore.skipped[0]
        assert version == 6 and "tier remote" in reason and "checksum mismatch" in reason
        # the object in the tier, not the scratch folder it was fetched to (gone by now)
        assert f"s3://{bucket}/run/v00000006/data.bin" in reason and ".fetch-" not in reason
        assert same(snapshot(model2), states[4])


def test_a_remote_version_holding_another_versions_files_is_not_taken_for_it(
    moto_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    """A bad copy (`aws s3 sync` gone wrong) put v4's manifest and data under v6's prefix,
    its marker sized to match: restore(version=6) returned v4's state as v6, silently (the
    manifest's version was checked only in folders named like a version)."""
    local = tmp_path / "local"
    states = uploaded_six(local, moto_server, bucket)
    s3 = moto_server.client()
    marker = json.loads(s3.get_object(Bucket=bucket, Key="run/v00000006/COMMITTED")["Body"].read())
    for name in ("manifest.json", "data.bin"):
        body = s3.get_object(Bucket=bucket, Key=f"run/v00000004/{name}")["Body"].read()
        s3.put_object(Bucket=bucket, Key=f"run/v00000006/{name}", Body=body)
        marker["files"][name] = len(body)
    s3.put_object(Bucket=bucket, Key="run/v00000006/COMMITTED", Body=json.dumps(marker).encode())
    shutil.rmtree(local)
    model2, opt2 = model_and_optimizer(seed=1)
    with checkpointer(local, moto_server, bucket, model2, opt2) as ckpt:
        with pytest.raises(CheckpointError, match=r"'version' is 4, but it is read as v00000006"):
            ckpt.restore(version=6)
        assert ckpt.restore() == 4  # the real v4, after v6 was skipped
        version, reason = ckpt.last_restore.skipped[0]
        assert version == 6 and f"s3://{bucket}/run/v00000006/manifest.json" in reason
        assert same(snapshot(model2), states[4])


def test_a_missing_bucket_without_create_is_an_error_not_an_empty_tier(
    moto_server: MotoServer, tmp_path: Path
) -> None:
    """A misspelt bucket with create=False listed as "no checkpoint yet": the job started
    from step 0 and every upload failed in the log only."""
    tier = remote(moto_server, "no-such-bucket-here", create=False)
    tier.name = "remote"
    with pytest.raises(TierError, match=r"the bucket 'no-such-bucket-here' does not exist"):
        tier.committed_versions()
    model, opt = model_and_optimizer()
    with (
        Checkpointer(tmp_path, model=model, optimizer=opt, tiers={"remote": tier}) as ckpt,
        pytest.raises(RestoreIOError, match="does not exist"),
    ):
        ckpt.restore()
    fresh = remote(moto_server, "no-such-bucket-either")  # create=True: a new run's bucket
    assert fresh.committed_versions() == []


@pytest.mark.slow
def test_bad_remote_configuration_and_an_unreachable_server(tmp_path: Path) -> None:
    with pytest.raises(TierError, match=r"nosuch://b/run.*scheme"):
        RemoteTier("nosuch://b/run")
    with pytest.raises(TierError, match="give a bucket"):
        RemoteTier("s3://")
    dead = MotoServer()  # a port nobody listens on
    tier = RemoteTier("s3://b/run", dead.storage_options(), timeout=3)
    tier.name = "remote"
    with pytest.raises(TierError, match=r"tier 'remote' \(s3://b/run\): cannot list"):
        tier.committed_versions()
    # Training does not need the remote: the Checkpointer starts, saves and closes promptly.
    model, opt = model_and_optimizer()
    tiers = Tiers({"remote": tier}, retries=1, backoff=0.05, drain_timeout=1.0)
    with Checkpointer(
        tmp_path / "local",
        model=model,
        optimizer=opt,
        tiers=tiers,
        placement=P.LocalPlusRemote(remote_every=1),
    ) as ckpt:
        step(model, opt, 1)
        assert ckpt.save(1).wait(timeout=30) == "committed"
        assert ckpt.restore() == 1 and ckpt.last_restore.unavailable  # says what it missed
    assert CheckpointDir(tmp_path / "local").committed_versions() == [1]
    # A new machine (empty local disk) whose remote is down cannot tell "no checkpoint" from
    # "the checkpoints are out of reach": restore raises instead of starting from step 0.
    tier = RemoteTier("s3://b/run", dead.storage_options(), timeout=3)
    tiers = Tiers({"remote": tier}, retries=1, backoff=0.05, drain_timeout=1.0)
    placement = P.LocalPlusRemote(remote_every=1)
    with Checkpointer(tmp_path / "new", model=model, tiers=tiers, placement=placement) as ckpt:
        with pytest.raises(RestoreIOError, match=r"cannot tell whether a checkpoint exists.*tier"):
            ckpt.restore()
        assert ckpt.last_restore is not None and ckpt.last_restore.unavailable
    assert CheckpointDir(tmp_path / "new").committed_versions() == []


def test_a_failed_download_names_the_object_and_keeps_type_and_errno() -> None:
    """The restore's retry and its message read the errno; the key says which object."""
    from pcframe.store.tiers.remote import _naming

    busy = _naming(OSError(16, "SlowDown"), "b/run/v00000003/data.bin")
    assert type(busy) is OSError and busy.errno == 16
    assert str(busy) == "[Errno 16] b/run/v00000003/data.bin: SlowDown"
    late = _naming(TimeoutError("get_file did not finish within 1.4 s"), "b/run/x")
    assert type(late) is TimeoutError
    assert str(late) == "b/run/x: get_file did not finish within 1.4 s"


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"url": "s3://b/run", "storage_option": {}}, r"tiers\.remote\.storage_option is not"),
        ({"url": "s3://b/run", "path": "/x"}, r"tiers\.remote\.path is not a remote tier"),
        ({"url": None}, r"url=None is not a URL"),
        ({"url": "s3://b/run", "timeout": "30"}, r"timeout='30': give a finite number > 0"),
        ({"url": "s3://b/run", "timeout": float("nan")}, r"timeout=nan: give a finite"),
        ({"url": "s3://b//run"}, r"an empty path segment"),
        ({"url": "s3://b/run*"}, r"a glob character"),
        ({"url": "s3://b/a[1]"}, r"a glob character"),
    ],
    ids=str,
)
def test_remote_tier_settings_are_refused_in_one_line_naming_the_key(options, words):
    """Typos were raw TypeErrors; NaN passed every check (close() then dropped every queued
    upload); s3://b//run wrote versions no listing ever found (restored as "no checkpoint");
    a glob character made retention delete another run's objects (run* matched runA)."""
    with pytest.raises(TierError, match=words) as err:
        Tiers({"remote": options})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("tiers", "kwargs", "words"),
    [
        (["s3://b/run"], {}, r"tiers: list given; give a mapping"),
        ({"../../precious": "s3://b/run"}, {}, r"'\.\./\.\./precious' is not a tier name"),
        ({}, {"retries": "5"}, r"retries='5': give a whole number"),
        ({}, {"drain_timeout": float("nan")}, r"drain_timeout=nan"),
        ({}, {"backoff": 0}, r"backoff=0: give a finite number > 0"),
        ({".hidden": "/x"}, {}, r"'\.hidden' is not a tier name"),
    ],
    ids=str,
)
def test_tier_sets_and_names_are_checked(tiers, kwargs, words):
    """A tier named with '/' or '..' reached the restore's scratch path (primary/.fetch-vN-
    <name>.tmp): a restore deleted a folder outside the checkpoint directory."""
    with pytest.raises(TierError, match=words):
        Tiers(tiers, **kwargs)


def test_an_endpoint_that_is_not_an_object_store_is_not_no_checkpoint(tmp_path: Path) -> None:
    """A service answering 404 to everything listed as an empty tier with create=True: a new
    machine restored nothing and trained from step 0, though the bucket held versions."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _answer

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        options = {
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{server.server_port}"},
        }
        tier = RemoteTier("s3://bucket/run", options, timeout=5)
        tier.name = "remote"
        with pytest.raises(TierError, match=r"tier 'remote' .*cannot create the root"):
            tier.committed_versions()
        model, opt = model_and_optimizer()
        tiers = Tiers({"remote": tier}, retries=0, backoff=0.05, drain_timeout=1.0)
        unknown = "cannot tell whether a checkpoint exists"
        with (
            Checkpointer(tmp_path, model=model, optimizer=opt, tiers=tiers) as ckpt,
            pytest.raises(RestoreIOError, match=unknown),
        ):
            ckpt.restore()
    finally:
        server.shutdown()


def test_tier_names_with_dots_and_numpy_numbers_are_accepted(tmp_path: Path) -> None:
    """What a config may hold and the checks must not refuse: a dotted name (the scratch
    folder .fetch-vN-nvme.1.tmp stays inside the checkpoint folder), numpy numbers."""
    import numpy as np

    tiers = Tiers({"nvme.1": tmp_path / "replica"}, retries=np.int64(2), backoff=np.float32(0.1))
    assert list(tiers.replicas) == ["nvme.1"] and tiers.retries == 2
    tiers.close()


def test_a_restore_racing_the_writers_retention_lists_again_for_the_newer_version(
    moto_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    """Another process restoring from an object store the live job uploads to and prunes
    (remote_keep=1): the version it listed was deleted while it was read, and the restore
    failed (RestoreIOError, or NoValidCheckpoint) though a newer version was whole."""
    model, opt = model_and_optimizer()
    states: dict = {}
    with Checkpointer(tmp_path / "job", model=model, optimizer=opt) as ckpt:
        for s in (1, 2):
            step(model, opt, s)
            ckpt.save(s).wait()
            states[s] = snapshot(model)
    writer = remote(moto_server, bucket)  # the live job's own tier, run by hand
    writer.name = "remote"
    writer.write(1, tmp_path / "job" / "v00000001", step=1)

    class Racing(RemoteTier):
        """The real tier; the job's next upload and its retention land while v1 is read."""

        def fetch(self, version: int, scratch: Path):
            if version == 1 and writer.committed_versions() != [2]:
                writer.write(2, tmp_path / "job" / "v00000002", step=2)
                writer.delete(1)
            return super().fetch(version, scratch)

    reader = Racing(f"s3://{bucket}/run", moto_server.storage_options(), timeout=10)
    fresh, fresh_opt = model_and_optimizer(seed=5)
    tiers = Tiers({"remote": reader}, backoff=0.05, backoff_max=0.2)
    with Checkpointer(tmp_path / "new", model=fresh, optimizer=fresh_opt, tiers=tiers) as ckpt:
        assert ckpt.restore() == 2 and ckpt.last_restore.tier == "remote"
    assert same(snapshot(fresh), states[2])


def test_a_notice_after_a_restart_secures_the_restored_version_the_bucket_holds(
    moto_server: MotoServer, bucket: str, tmp_path: Path, caplog
) -> None:
    """Version 6, uploaded by the process before, restored by this one from the local disk:
    a notice answered without a save finds it in the bucket (its manifest's checksum the
    local one's, read from the manifest's first bytes) and it is durable there at once."""
    local = tmp_path / "local"
    uploaded_six(local, moto_server, bucket)
    tier = remote(moto_server, bucket)
    assert tier.manifest_crc(6) == manifest_crc(local / "v00000006" / "manifest.json")
    with pytest.raises(TierError, match=r"v00000005/manifest\.json is missing"):
        tier.manifest_crc(5)
    source = P.ManualNoticeSource(window=60.0)
    model, opt = model_and_optimizer(seed=1)
    with Checkpointer(
        local,
        model=model,
        optimizer=opt,
        policy=P.NoticeDriven(P.FixedSteps(1), save_time_prior=0.5, margin=120.0),
        notices=[source],
        tiers=Tiers({"remote": remote(moto_server, bucket)}, backoff=0.05, backoff_max=0.2),
        placement=P.LocalPlusRemote(remote_every=2, local_keep=2, remote_keep=2),
        keep_last=2,
        chunk_bytes=8192,
    ) as ckpt:
        assert ckpt.restore() == 6 and ckpt.last_restore.tier == "local"
        source.trigger(time.monotonic())
        step(model, opt, 7)
        assert ckpt.maybe_save(7) is None  # 60 s left, less than the margin: no save
        secured = ckpt.last_secured
        assert (secured.version, secured.tiers, secured.durable) == (6, ("remote",), True)
        assert ckpt.tiers.status()["remote"].written == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert remote(moto_server, bucket).committed_versions() == [4, 6]


def test_a_tier_listed_later_is_swept_after_its_first_write_not_when_it_opens(
    moto_server: MotoServer, bucket: str, tmp_path: Path
) -> None:
    # A multi-rank job's ranks leave the object store unlisted while they open (rank 0 lists
    # it once for every rank); each rank's worker still swept it as it started, building that
    # rank's object-store client (0.26 CPU-s) on the way to its first step after a restart.
    model, opt = model_and_optimizer()
    with Checkpointer(tmp_path / "primary", model=model, optimizer=opt) as ckpt:
        for version in (1, 2):
            step(model, opt, version)
            ckpt.save(version).wait()
    tier = remote(moto_server, bucket)
    tier.name = "remote"
    tier.write(1, CheckpointDir(tmp_path / "primary").path(1), step=1)
    leftover = "run/v00000000/data.bin"  # an upload that died before its marker, below v1
    moto_server.client().put_object(Bucket=bucket, Key=leftover, Body=b"half")

    primary = WritableCheckpointDir(tmp_path / "primary")
    try:
        tiers = Tiers({"remote": tier}, backoff=0.05, backoff_max=0.2)
        tiers.list_later("remote")
        tiers.attach(primary, keep_last=2)
        tiers.close()  # the worker has started and ended without a version to write
        assert leftover in moto_server.keys(bucket)

        tiers = Tiers({"remote": remote(moto_server, bucket)}, backoff=0.05, backoff_max=0.2)
        tiers.list_later("remote")
        tiers.attach(primary, keep_last=2)
        v2 = primary.path(2)
        tiers.on_commit(2, v2, read_manifest(str(v2 / MANIFEST_NAME)))
        assert tiers.wait_idle(30)
        assert tiers.status()["remote"].last_written == 2
        tiers.close()
    finally:
        primary.close()
    assert leftover not in moto_server.keys(bucket)  # swept after that first write
