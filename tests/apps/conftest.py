"""Shared helpers of the app tests: composing configs, running the console scripts."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pcframe.apps.compose import compose_config

CONF = Path(__file__).resolve().parents[2] / "conf"


def compose(config_name: str, *overrides: str, directory: Path | None = None):
    """Compose like the console script; ``directory`` replaces the Hydra output folder."""
    extra = [f"storage.directory={directory}"] if directory is not None else []
    return compose_config(config_name, [*extra, *overrides])


def run_module(module: str, *args: str, cwd: Path, env: dict, timeout: float = 300):
    """Run ``python -m module args`` as the console script would; returns CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Small models on a shared 2-core machine: more threads only contend. Restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def app_env(child_env, tmp_path) -> dict[str, str]:
    """Child environment whose user config folder (engine=tuned) is inside tmp_path."""
    env = dict(child_env)
    env["PCFRAME_CONFIG_DIR"] = str(tmp_path / "user-conf")
    return env


@pytest.fixture
def traces_dir() -> Path:
    from pcframe.policies.traces import shared_traces_dir

    path = shared_traces_dir()
    if path is None:
        pytest.skip("no shipped traces in this checkout (experiments/traces or PCFRAME_TRACES)")
    return path


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_url():
    """A throwaway PostgreSQL server on loopback for this test session; yields its URL.

    Skips (with the reason) when the server binaries or the Python driver are missing; on
    Debian/Ubuntu: ``apt-get install postgresql`` and ``pip install 'pcframe[postgres]'``.
    """
    psycopg = pytest.importorskip(
        "psycopg", reason="needs psycopg: pip install 'pcframe[postgres]'"
    )

    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL server (initdb, pg_ctl) not installed: apt-get install postgresql")
    prefix: list[str] = []
    owner = None
    if os.geteuid() == 0:  # the server refuses to run as root
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        prefix = [shutil.which("runuser") or "runuser", "-u", "postgres", "--"]
    root = Path(tempfile.mkdtemp(prefix="pcframe-pg-"))  # not under pytest's 0700 tmp
    os.chmod(root, 0o755)
    if owner is not None:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    data, port = root / "data", _free_port()

    def as_owner(*cmd: str) -> None:
        subprocess.run([*prefix, *cmd], check=True, capture_output=True, timeout=120)

    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=on"
    try:
        as_owner(initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        as_owner(pg_ctl, "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        # The binaries are there but this machine cannot run a server (no shared memory,
        # a sandbox without setuid for runuser, ...): skip, saying why.
        log = root / "log"
        detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")[-500:]
        if log.exists():
            detail += log.read_text(errors="replace")[-500:]
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"could not start a PostgreSQL server on loopback: {exc}; {detail.strip()}")
    try:
        # CREATE DATABASE cannot run inside a transaction: autocommit.
        with psycopg.connect(
            host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute("CREATE DATABASE pcframe_tune")
        yield f"postgresql://postgres@127.0.0.1:{port}/pcframe_tune"
    finally:
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(root, ignore_errors=True)
