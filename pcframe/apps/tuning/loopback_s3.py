"""An S3-compatible server on loopback (moto's server mode) as a real remote tier to tune for.

The server is a separate process on this machine, so an upload is real HTTP through the
kernel's loopback, real request signing and MD5s in botocore, and real CPU spent by the
server, competing with training for the same cores, as a close object store's would not.
Its limit for a checkpoint is its measured PUT rate (:func:`put_rate`).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from typing import Any

from pcframe.errors import ConfigError
from pcframe.runtime.processes import dying_with_parent, module_command

NEEDS = ("moto", "s3fs", "boto3")


def check_s3_possible(key: str) -> None:
    """A one-line :class:`ConfigError` naming the missing package, if one is missing."""
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"{key}: the loopback S3 target needs {', '.join(missing)} (not installed); "
            "pip install 'moto[server]' s3fs boto3, or pick another target such as "
            "tune/target=tmpfs"
        )


class LoopbackS3:
    """``python -m moto.server`` on 127.0.0.1 with one fresh bucket; stopped on exit."""

    def __init__(self, bucket: str | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.bucket = bucket or f"pcframe-tune-{uuid.uuid4().hex[:8]}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str = "limits") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def storage_options(self) -> dict[str, Any]:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }

    def tier(self, prefix: str) -> dict[str, Any]:
        """The tier spec for ``Checkpointer(tiers={"s3": ...})`` (see ``make_tier``).

        One prefix per measurement: a remote tier has one writer, and a fresh engine must
        not find the versions of the previous trial there.
        """
        return {"url": self.url(prefix), "storage_options": self.storage_options()}

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def start(self, timeout: float = 60.0) -> None:
        """Start the server on this port and wait until it answers."""
        # Armed to end with this process: a SIGKILLed pcframe-tune leaves no server behind.
        self.proc = subprocess.Popen(
            module_command("moto.server", "-H", "127.0.0.1", "-p", str(self.port)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dying_with_parent({**os.environ, "PYTHONWARNINGS": "ignore"}),
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ConfigError(
                    f"tune.target=s3: the moto server exited with {self.proc.returncode} "
                    f"(run `{sys.executable} -m moto.server` to see why)"
                )
            try:
                with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1.0):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ConfigError(
                        f"tune.target=s3: the moto server did not answer within {timeout:.0f} s"
                    ) from None
                time.sleep(0.05)

    def __enter__(self) -> LoopbackS3:
        self.start()
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def put_rate(server: LoopbackS3, nbytes: int, repeats: int = 3) -> tuple[float, float, float]:
    """Bytes/s of one PUT of ``nbytes`` through s3fs, as the tier uploads: median, low, high."""
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(server.url(), skip_instance_cache=True, **server.storage_options())
    payload = os.urandom(max(nbytes, 1 << 20))  # below 1 MiB a PUT is all request overhead
    rates = []
    for i in range(repeats):
        key = f"{root}/.limit-{os.getpid()}-{i}"
        start = time.perf_counter()
        fs.pipe_file(key, payload)
        rates.append(len(payload) / (time.perf_counter() - start))
        fs.rm_file(key)
    return statistics.median(rates), min(rates), max(rates)
