"""The object store of a multi-rank job (:mod:`pcframe.distributed.remote_shards`): its global
records are written and read within the tier's deadline, and a store that fails says so
(a :class:`TierError`), never "no record"."""

from __future__ import annotations

import contextlib
import time

import pytest

from pcframe.distributed.global_versions import GlobalRecord, ShardRef
from pcframe.distributed.remote_shards import MAX_RECORD_BYTES, RemoteShards
from pcframe.errors import TierError


def record(version: int) -> GlobalRecord:
    shard = ShardRef(0, f"rank-0/v{version:08d}", version, version * 3, "0" * 8, 8)
    return GlobalRecord(version, version * 3, 0.0, 1, (shard,))


def shards(server, bucket: str, timeout: float = 10.0) -> RemoteShards:
    # the client's own timeouts longer than the tier's deadline, as users leave them
    storage = server.storage_options(read_timeout=30, retries={"max_attempts": 2})
    options = {"storage_options": storage, "timeout": timeout}
    return RemoteShards(f"s3://{bucket}/job", options)


def test_records_are_written_kept_to_the_newest_two_and_read_back(moto_server, bucket):
    store = shards(moto_server, bucket)
    assert store.records() == {}  # nothing yet: not an error
    for version in (1, 2, 3):
        store.put_record(record(version))
    assert store.records() == {2: record(2).to_bytes(), 3: record(3).to_bytes()}
    moto_server.client().put_object(
        Bucket=bucket, Key="job/global/v00000009.json", Body=b"x" * (MAX_RECORD_BYTES + 1)
    )
    assert sorted(store.records()) == [2, 3]  # a record too large to be one is left out


def test_a_stalled_store_fails_within_the_deadline_not_the_clients_retries(own_moto_server, bucket):
    """Before: put_record (rank 0's round thread) and records (the restore) called the file
    system directly, past the tier's deadline: still blocked after 8 minutes."""
    store = shards(own_moto_server, bucket)  # the default deadline: a busy machine is slow
    store.put_record(record(1))
    stalled = shards(own_moto_server, bucket, timeout=2.0)
    for _ in range(20):  # its root ready (each try bounded by its deadline), as in a job
        with contextlib.suppress(TierError):
            stalled.records()
            break
    own_moto_server.pause()
    try:
        for call in (lambda: stalled.put_record(record(2)), stalled.records):
            started = time.monotonic()
            with pytest.raises(TierError, match=r"did not finish within 2\.0 s"):
                call()
            assert time.monotonic() - started < 30  # the deadline, not the client's retries
    finally:
        own_moto_server.resume()
    assert sorted(store.records()) == [1]


def test_a_store_that_is_down_raises_rather_than_reading_as_empty(own_moto_server, bucket):
    store = shards(own_moto_server, bucket)
    store.put_record(record(1))
    own_moto_server.kill()
    with pytest.raises(TierError, match="remote/global"):
        store.records()


def test_an_empty_record_object_is_read_not_taken_for_an_unreadable_store(moto_server, bucket):
    """A ranged read of an empty object is refused by S3 (416): one empty record made the
    whole store unreadable to a restore."""
    store = shards(moto_server, bucket)
    store.put_record(record(1))
    moto_server.client().put_object(Bucket=bucket, Key="job/global/v00000005.json", Body=b"")
    assert store.records() == {1: record(1).to_bytes(), 5: b""}  # 5: refused as damaged later
