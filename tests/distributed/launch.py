"""Start a job of N real rank processes the way torchrun does, on loopback.

Every rank is its own ``python -m tests.distributed.worker`` process with the torchrun
environment contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Like torchrun,
when one rank dies the others are killed, so a SIGKILLed rank ends the whole job.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from tests.warm import STACKS_SIGNAL, WarmProcess

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PCFRAME_CRASH_AT", None)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        MASTER_ADDR="127.0.0.1",
    )
    return env


@dataclass
class JobResult:
    returncodes: list[int]
    logs: list[str]

    def check(self) -> None:
        if any(self.returncodes):
            detail = "\n".join(
                f"--- rank {r} (rc {rc}) ---\n{log[-3000:]}"
                for r, (rc, log) in enumerate(zip(self.returncodes, self.logs, strict=True))
            )
            raise AssertionError(f"job failed: {self.returncodes}\n{detail}")


def run_job(
    world_size: int,
    args: list[str],
    logdir: Path,
    rank_env: dict[int, dict[str, str]] | None = None,
    timeout: float = 120.0,
    kill_on_failure: bool = True,
) -> JobResult:
    """Run ``tests.distributed.worker args`` on ``world_size`` ranks; kill all if one dies
    (``kill_on_failure=False``: let the others find out for themselves, up to ``timeout``)."""
    env = base_env()
    env.update(WORLD_SIZE=str(world_size), MASTER_PORT=str(free_port()))
    logdir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for rank in range(world_size):
        rank_specific = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        rank_specific.update((rank_env or {}).get(rank, {}))
        log = open(logdir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            WarmProcess("tests.distributed.worker", args, env=rank_specific, cwd=REPO, log=log.name)
        )
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = kill_on_failure and any(p.returncode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                if not failed:  # a rank that hangs: its threads' stacks into its log first
                    for p in procs:
                        p.send_signal(STACKS_SIGNAL)
                time.sleep(0.5 if failed else 2.0)  # let a dying job flush its logs
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGKILL)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    texts = [(logdir / f"rank{r}.log").read_text() for r in range(world_size)]
    return JobResult([p.returncode for p in procs], texts)
