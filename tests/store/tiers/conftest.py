"""A real S3-compatible server on loopback (moto's server mode, as a killable subprocess)."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pcframe.apps.tuning.loopback_s3 import LoopbackS3


class MotoServer(LoopbackS3):
    """The tuner's loopback server (``start``, ``client``), which these tests may also
    SIGKILL, stop and restart on the same port."""

    def kill(self) -> None:
        """A real crash: SIGKILL, everything the server held in memory is gone."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)  # in case it was stopped
        self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        """A stalled server: the process is stopped, connections hang without an answer."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def storage_options(self, **config: Any) -> dict[str, Any]:
        """s3fs options: this endpoint, fixed credentials, short client-side timeouts."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint},
            "config_kwargs": {
                "connect_timeout": 2,
                "read_timeout": 5,
                "retries": {"max_attempts": 1},
                **config,
            },
        }

    def keys(self, bucket: str) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def parts_in_flight(self, bucket: str) -> dict[str, int]:
        """Multipart uploads not yet completed: key -> parts already received."""
        s3 = self.client()
        found: dict[str, int] = {}
        try:
            uploads = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        except s3.exceptions.NoSuchBucket:
            return found  # the tier has not created it yet
        for upload in uploads:
            parts = s3.list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            found[upload["Key"]] = len(parts.get("Parts", []))
        return found

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """One server for the tests that do not kill it (each uses its own bucket)."""
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_moto_server() -> Iterator[MotoServer]:
    """A server this test may kill, stop and restart."""
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def bucket() -> str:
    return f"ckpt-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory on /dev/shm (a real tmpfs) for a memory tier, removed afterwards."""
    import shutil

    path = Path("/dev/shm") / f"pcframe-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)
