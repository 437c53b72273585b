"""A plain training loop with pcframe checkpointing, shared by the apps, tests and benchmarks.

Also runnable as a child process (``python -m pcframe.apps.training``): the crash and resume
tests and the preemption supervisor start it, SIGKILL it, and start it again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pcframe.apps.workloads import Workload, build
from pcframe.checkpointer import Checkpointer
from pcframe.config import EngineConfig
from pcframe.feed import process_age
from pcframe.policies.base import IntervalPolicy
from pcframe.policies.fixed import FixedSteps
from pcframe.runtime.processes import arm_from_environment
from pcframe.save.status import SaveStatus


@dataclass
class TrainResult:
    steps: int
    start_step: int
    seconds: float
    losses: list[float] = field(default_factory=list)
    restored_from: int | None = None
    stopped_at: int | None = None  # the step of a planned stop, or of a notice
    noticed: bool = False  # stopped on a preemption notice (its emergency version durable)

    @property
    def steps_per_second(self) -> float:
        last = self.stopped_at if self.stopped_at is not None else self.steps
        return (last - self.start_step) / self.seconds if self.seconds else 0.0


def batches(workload: Workload) -> Iterator[Any]:
    while True:
        yield from workload.loader


class CommitWatch:
    """Calls ``on_commit(count, step)`` when a checkpointer's committed versions grow.

    Looks only at versions not yet finished, so watching costs nothing per step however
    many versions a long run has written.
    """

    def __init__(self, checkpointer: Checkpointer, on_commit: Callable[[int, int], None]):
        self.checkpointer = checkpointer
        self.on_commit = on_commit
        self.count = 0
        self._known = 0
        self._pending: list[int] = []

    def poll(self) -> None:
        records = self.checkpointer.records
        if len(records) != self._known:
            self._pending += list(records)[self._known :]
            self._known = len(records)
        if not self._pending:
            return
        still = []
        for version in self._pending:
            record = records[version]
            if record.status == SaveStatus.COMMITTED:
                self.count += 1
                self.on_commit(self.count, record.step)
            elif not record.status.finished:
                still.append(version)
        self._pending = still


def train(
    workload: Workload,
    steps: int,
    directory: str | Path | None = None,
    policy: IntervalPolicy | None = None,
    engine: EngineConfig | None = None,
    progress: Any = None,
    on_restored: Any = None,
    on_commit: Callable[[int, int], None] | None = None,
    stop: Callable[[int], bool] | None = None,
    stop_on_notice: bool = False,
) -> tuple[TrainResult, Checkpointer | None]:
    """Train to ``steps`` total, resuming from ``directory`` when it holds a checkpoint.

    ``progress(step)`` is called after every step, ``on_restored(step, seconds)`` once after
    the restore attempt (step ``None`` when there was nothing to resume from), and
    ``on_commit(count, step)`` each time a version commits (``count`` committed so far).
    ``stop(step)``, asked after every step, ends training early when it returns true (a
    planned stop: the job moves to other VMs): that step is saved unless a version already
    holds it, and everything in flight is durable before ``train`` returns.
    ``stop_on_notice``: end training at the step a preemption notice arrived (its emergency
    version saved by the policy), as a job that is about to lose its VM does; a supervised
    replay's child trains on until its kill instead (the supervisor restarts it then).
    Returns the result and the (closed) checkpointer, whose ``records`` hold per-save costs.
    """
    checkpointer = None
    start_step = 0
    if directory is not None:
        checkpointer = Checkpointer(
            directory,
            model=workload.model,
            optimizer=workload.optimizer,
            scheduler=workload.scheduler,
            data=workload.loader,
            policy=policy or FixedSteps(10),
            config=engine,
        )
        restored = checkpointer.restore()
        start_step = restored or 0
        if on_restored is not None:
            report = checkpointer.last_restore
            on_restored(restored, report.seconds if report else 0.0)
    watch = CommitWatch(checkpointer, on_commit) if checkpointer and on_commit else None
    result = TrainResult(steps, start_step, 0.0, restored_from=start_step or None)
    stream = batches(workload)
    begin = time.perf_counter()
    try:
        for step in range(start_step + 1, steps + 1):
            result.losses.append(workload.train_step(next(stream)))
            if checkpointer is not None:
                checkpointer.maybe_save(step)
                if watch is not None:
                    watch.poll()
                if stop_on_notice and checkpointer.notice is not None:
                    # The VM goes soon and this step's emergency version is durable (the
                    # policy saved it, or it could not in time): leave, as the README's
                    # loop does, rather than train on into the kill.
                    result.stopped_at, result.noticed = step, True
                    break
            if progress is not None:
                progress(step)
            if stop is not None and stop(step):
                result.stopped_at = step
                if checkpointer is not None and not _holds(checkpointer, step):
                    checkpointer.save(step, reason="planned stop")
                break
        if checkpointer is not None:
            checkpointer.wait()
            if watch is not None:
                watch.poll()
    finally:
        result.seconds = time.perf_counter() - begin
        if checkpointer is not None:
            checkpointer.close()
    return result, checkpointer


def _holds(checkpointer: Checkpointer, step: int) -> bool:
    """Whether a version of ``step`` is committed or still on its way."""
    return any(
        record.step == step and record.status in (SaveStatus.IN_FLIGHT, SaveStatus.COMMITTED)
        for record in checkpointer.records.values()
    )


EVENT_PREFIX = "pcframe-event "


def emit(event: str, **fields: Any) -> None:
    """One machine-readable line on stdout for a supervisor (see pcframe.apps.preemption)."""
    print(EVENT_PREFIX + json.dumps({"event": event, **fields}), flush=True)


def build_policy(args: argparse.Namespace) -> IntervalPolicy:
    if args.policy:
        from hydra.utils import instantiate

        return instantiate(json.loads(args.policy))
    return FixedSteps(args.every)


def save_final(workload: Workload, path: str) -> None:
    """Parameters and optimizer state as safetensors, to compare runs bit for bit."""
    from safetensors.torch import save_file

    tensors = {f"model/{k}": v.contiguous() for k, v in workload.model.state_dict().items()}
    for index, state in workload.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            tensors[f"optimizer/{index}/{key}"] = value.reshape(-1).contiguous()
    save_file(tensors, path)


def main(argv: list[str] | None = None) -> int:
    arm_from_environment()  # a supervisor killed with SIGKILL takes this child with it
    parser = argparse.ArgumentParser(description="pcframe training child process")
    parser.add_argument("--directory", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument(
        "--policy", help="JSON interval-policy config with a _target_ (replaces --every)"
    )
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--workload-args", default="{}", help="JSON kwargs of the workload")
    parser.add_argument("--engine-args", default="{}", help="JSON EngineConfig overrides")
    parser.add_argument("--final", help="write final parameters + optimizer state here")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    workload = build(args.workload, **json.loads(args.workload_args))
    restored = False

    def progress(step: int) -> None:
        nonlocal restored
        if not restored:
            # The first step after start-up: the restart is over, training runs again.
            restored = True
            emit("first_step", step=step, age=process_age())
        print(f"step {step}", flush=True)

    result, checkpointer = train(
        workload,
        args.steps,
        args.directory,
        build_policy(args),
        EngineConfig(**json.loads(args.engine_args)),
        progress,
        on_restored=lambda step, seconds: emit(
            "restored", step=step or 0, seconds=seconds, age=process_age()
        ),
        on_commit=lambda count, step: emit("committed", step=step, count=count),
    )
    print(f"done start={result.start_step} steps={result.steps}", flush=True)
    if args.final:
        save_final(workload, args.final)
    records = [r for r in checkpointer.records.values() if r.status == "committed"]
    emit(
        "done",
        start=result.start_step,
        steps=result.steps,
        seconds=result.seconds,
        checkpoints=len(records),
        stall=sum(r.stall for r in records),
        durable=sum(r.durable for r in records),
        nbytes=sum(r.nbytes for r in records),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
