"""Run training as a child process, SIGKILL it at injected times, restart it, measure.

The child is ``python -m pcframe.apps.training`` in its own session. It is killed with SIGKILL,
which it can neither catch nor delay: no final save, no flush, no cleanup, as when a spot VM
disappears. The next child resumes from whatever the engine had committed. The supervisor
only reads the child's stdout (``step N`` after every step, ``pcframe-event {json}`` lines),
so what it reports is what an outside observer sees.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TextIO

from pcframe.apps.training import EVENT_PREFIX
from pcframe.errors import SupervisorError
from pcframe.runtime.processes import dying_with_parent

EOF = object()  # the end of a child's stdout on its line queue


class KillClock(Enum):
    """What a kill time counts."""

    # Wall seconds since the first spawn, start-ups and restart delays included, as a VM's
    # clock: a kill can land while a process imports or restores.
    JOB = "job"
    # Seconds some process spent training (from each process's first step on). A derived
    # schedule uses it, so that how long start-ups take (a cold page cache, a loaded machine)
    # cannot move the kills past the end of the run.
    TRAINING = "training"

    @property
    def unit(self) -> str:
        """How a time on this clock reads in a message: "3.0{unit}"."""
        return " s of training" if self is KillClock.TRAINING else " s"


@dataclass
class ChildSpec:
    """Everything one training process needs; the same for every restart."""

    directory: str
    steps: int
    workload: str = "mlp"
    workload_args: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    policy: dict[str, Any] | None = None
    threads: int = 1
    final: str | None = None

    def command(self, python: str = sys.executable) -> list[str]:
        cmd = [
            python,
            "-m",
            "pcframe.apps.training",
            "--directory",
            self.directory,
            "--steps",
            str(self.steps),
            "--workload",
            self.workload,
            "--workload-args",
            json.dumps(self.workload_args),
            "--engine-args",
            json.dumps(self.engine),
            "--threads",
            str(self.threads),
        ]
        if self.policy is not None:
            cmd += ["--policy", json.dumps(self.policy)]
        if self.final:
            cmd += ["--final", self.final]
        return cmd


@dataclass
class Life:
    """One child process, from spawn to exit or kill. Times are seconds on the job clock."""

    index: int
    spawned: float
    start_step: int | None = None  # None: killed before it had restored
    last_step: int = 0
    restore_seconds: float = 0.0
    first_step_at: float | None = None
    ended: float = 0.0
    killed: bool = False
    returncode: int | None = None
    commits: int = 0  # versions this process committed (its ``committed`` events)
    commit_steps: list[int] = field(default_factory=list)
    done: dict[str, Any] | None = None  # the ``done`` event of a process that finished

    @property
    def training_seconds(self) -> float:
        """From the first step to the end of the process (0 if it never trained)."""
        return self.ended - self.first_step_at if self.first_step_at is not None else 0.0

    @property
    def startup_seconds(self) -> float | None:
        """From spawn to the end of the first step (interpreter, imports, restore)."""
        return self.first_step_at - self.spawned if self.first_step_at is not None else None

    @property
    def executed(self) -> int:
        return 0 if self.start_step is None else max(0, self.last_step - self.start_step)


@dataclass
class SupervisedRun:
    """What a supervised run cost; ``lives`` has one entry per process started."""

    steps: int
    lives: list[Life]
    wall: float
    scheduled_kills: int

    @property
    def kills(self) -> int:
        return sum(life.killed for life in self.lives)

    @property
    def commits(self) -> int:
        """Checkpoint versions committed, by every process together."""
        return sum(life.commits for life in self.lives)

    @property
    def executed_steps(self) -> int:
        return sum(life.executed for life in self.lives)

    @property
    def lost_steps(self) -> int:
        """Steps trained and then lost to kills (as seen on stdout: ±1 step per kill).

        Work since the newest checkpoint dies with a process; the next process that gets as
        far as restoring shows how far back it had to go.
        """
        lost = 0
        for i, life in enumerate(self.lives):
            if life.killed and life.start_step is not None:
                resumed = next(
                    (x.start_step for x in self.lives[i + 1 :] if x.start_step is not None), 0
                )
                lost += max(0, life.last_step - resumed)
        return lost

    @property
    def restart_seconds(self) -> list[float]:
        """Per kill: from the kill until training made progress again (its next first step,
        in whichever later process got that far)."""
        out = []
        for i, life in enumerate(self.lives):
            if not life.killed:
                continue
            resumed = next((x.first_step_at for x in self.lives[i + 1 :] if x.first_step_at), None)
            if resumed is not None:
                out.append(resumed - life.ended)
        return out

    @property
    def whole_restarts(self) -> list[float]:
        """Per kill whose next process trained a step: from the kill to that first step
        (what one restart costs). Unlike :attr:`restart_seconds`, a kill during a restart
        does not make one sample spanning both restarts (and one more for the interrupted
        process)."""
        return [
            after.first_step_at - life.ended
            for life, after in itertools.pairwise(self.lives)
            if life.killed and after.first_step_at is not None
        ]

    @property
    def goodput(self) -> float:
        """Useful training steps per wall second, restarts and lost work included."""
        return self.steps / self.wall if self.wall else 0.0


class Supervisor:
    """Start a child, kill it at ``kill_times`` (seconds on ``clock``), restart until it finishes.

    The job clock starts when the first child is spawned and includes every start-up and
    restart delay, as a VM's wall clock would. Kill times that fall while no child is
    running (during ``restart_delay``) are skipped: a VM that is not up cannot be preempted.
    On the training clock no kill falls outside training, so none is skipped. Every time
    the supervisor reports (``Life``) is on the job clock.
    ``on_line(life_index, line)`` sees every stdout line of every child (progress displays).
    """

    def __init__(
        self,
        spec: ChildSpec,
        kill_times: Sequence[float] = (),
        *,
        restart_delay: float = 0.0,
        clock: KillClock = KillClock.JOB,
        timeout: float = 3600.0,
        log_dir: str | Path | None = None,
        env: dict[str, str] | None = None,
        on_line: Callable[[int, str], None] | None = None,
    ) -> None:
        if restart_delay < 0:
            raise ValueError(f"restart_delay={restart_delay} must be >= 0")
        self.spec = spec
        self.kill_times = sorted(kill_times)
        self.restart_delay = restart_delay
        self.clock = clock
        self.timeout = timeout
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.env = child_env(env, spec.threads)
        self.on_line = on_line

    def run(self) -> SupervisedRun:
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        lives: list[Life] = []
        pending = list(self.kill_times)
        start = time.monotonic()
        while True:
            trained = sum(life.training_seconds for life in lives)
            now = time.monotonic() - start if self.clock is KillClock.JOB else trained
            pending = [t for t in pending if t > now]
            life = self._run_life(len(lives), start, pending, trained)
            lives.append(life)
            if not life.killed:
                return SupervisedRun(self.spec.steps, lives, life.ended, len(self.kill_times))
            pending.pop(0)
            if self.restart_delay:
                time.sleep(self.restart_delay)

    # --- one process ---------------------------------------------------------------------

    def _run_life(self, index: int, start: float, pending: list[float], trained: float) -> Life:
        def clock() -> float:
            return time.monotonic() - start

        life = Life(index, spawned=clock())
        stderr_path = self._log_path(index)
        with open(stderr_path or os.devnull, "w") as stderr:
            proc = subprocess.Popen(
                self.spec.command(),
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                # its own process group: the kill takes everything; and a SIGKILLed
                # supervisor takes it too (the child arms that: pcframe.apps.training)
                env=dying_with_parent(self.env),
                start_new_session=True,
            )
            lines: queue.Queue[Any] = queue.Queue()
            reader = threading.Thread(target=pump_lines, args=(proc.stdout, lines), daemon=True)
            reader.start()
            try:
                self._watch(proc, life, lines, clock, pending, start, trained)
            except BaseException:
                kill_group(proc)
                raise
            finally:
                reader.join()
                proc.stdout.close()
        life.ended = clock() if not life.killed else life.ended
        life.returncode = proc.returncode
        if not life.killed and proc.returncode != 0:
            raise SupervisorError(
                f"training process {index} exited with code {proc.returncode} without being "
                f"killed; its stderr ends with:\n{_tail(stderr_path)}"
            )
        return life

    def _watch(
        self,
        proc: subprocess.Popen[str],
        life: Life,
        lines: queue.Queue[Any],
        clock: Any,
        pending: list[float],
        start: float,
        trained: float,
    ) -> None:
        while True:
            now = clock()
            next_kill = self._next_kill(life, pending, trained)
            if now >= self.timeout:
                raise SupervisorError(
                    f"supervised run exceeded failure.timeout={self.timeout} s at step "
                    f"{life.last_step}/{self.spec.steps}; raise the timeout or shorten the run"
                )
            wait = min(next_kill, self.timeout) - now
            try:
                item = lines.get(timeout=max(wait, 0.0))
            except queue.Empty:
                if clock() < next_kill:
                    continue  # the timeout check comes round again
                # The kill's time, before the reap (a process holding much memory takes a
                # while to go): on the training clock the reap is no training time.
                life.killed, life.ended = True, clock()
                kill_group(proc)
                # Lines the child wrote before it died are still in the pipe: count them.
                while (item := lines.get()) is not EOF:
                    self._parse(item[1], life, item[0] - start)
                return
            if item is EOF:
                proc.wait()
                return
            self._parse(item[1], life, item[0] - start)

    def _next_kill(self, life: Life, pending: list[float], trained: float) -> float:
        """When the next kill falls on the job clock; ``trained``: training seconds of the
        lives before this one (infinite: no kill is pending, or it is not yet known)."""
        if not pending:
            return float("inf")
        if self.clock is KillClock.JOB:
            return pending[0]
        if life.first_step_at is None:
            return float("inf")  # the training clock stands still while a process starts
        return life.first_step_at + pending[0] - trained

    def _parse(self, line: str, life: Life, at: float) -> None:
        if self.on_line is not None:
            self.on_line(life.index, line)
        record_line(line, life, at)

    def _log_path(self, index: int) -> Path | None:
        if self.log_dir is None:
            return None
        return self.log_dir / f"child-{index}.stderr"


def record_line(line: str, life: Life, at: float) -> None:
    """What one stdout line of a training child (``at``: its time on the job clock) tells
    about its life: its steps, restore, first step, commits and end."""
    if line.startswith("step "):
        life.last_step = int(line.split()[1])
    elif line.startswith(EVENT_PREFIX):
        event = json.loads(line[len(EVENT_PREFIX) :])
        if event["event"] == "restored":
            life.start_step = life.last_step = int(event["step"])
            life.restore_seconds = float(event["seconds"])
        elif event["event"] == "first_step":
            life.first_step_at = at
        elif event["event"] == "committed":
            life.commits += 1
            life.commit_steps.append(int(event["step"]))
        elif event["event"] == "done":
            life.done = event


def pump_lines(stream: TextIO, lines: queue.Queue[Any]) -> None:
    """Puts each line of ``stream`` on ``lines`` as (monotonic time, line), then ``EOF``."""
    for line in stream:
        lines.put((time.monotonic(), line.rstrip("\n")))
    lines.put(EOF)


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child's whole process group (a VM gone) and reap it."""
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def child_env(env: dict[str, str] | None, threads: int) -> dict[str, str]:
    """The environment of a training child: unbuffered, ``threads`` BLAS threads, the
    engine's own crash points off."""
    merged = dict(os.environ if env is None else env)
    merged.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    merged.pop("PCFRAME_CRASH_AT", None)  # the engine's own crash points stay off here
    return merged


def _tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.exists():
        return "(no log; pass log_dir to keep the child's stderr)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def compare_finals(a: str | Path, b: str | Path) -> list[str]:
    """Names of tensors that differ between two ``--final`` safetensors files (empty: equal)."""
    import torch
    from safetensors.torch import load_file

    left, right = load_file(a), load_file(b)
    names = sorted(set(left) | set(right))
    return [
        n for n in names if n not in left or n not in right or not torch.equal(left[n], right[n])
    ]
