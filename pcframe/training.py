"""A plain training loop with pcframe checkpointing, shared by the apps, tests and benchmarks.

Also runnable as a child process (``python -m pcframe.training``): the crash and resume
tests and the preemption supervisor start it, SIGKILL it, and start it again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pcframe.checkpointer import Checkpointer
from pcframe.config import EngineConfig
from pcframe.policies.base import IntervalPolicy
from pcframe.policies.fixed import FixedSteps
from pcframe.workloads import Workload, build


@dataclass
class TrainResult:
    steps: int
    start_step: int
    seconds: float
    losses: list[float] = field(default_factory=list)
    restored_from: int | None = None

    @property
    def steps_per_second(self) -> float:
        return (self.steps - self.start_step) / self.seconds if self.seconds else 0.0


def batches(workload: Workload) -> Iterator[Any]:
    while True:
        yield from workload.loader


def train(
    workload: Workload,
    steps: int,
    directory: str | Path | None = None,
    policy: IntervalPolicy | None = None,
    engine: EngineConfig | None = None,
    progress: Any = None,
) -> tuple[TrainResult, Checkpointer | None]:
    """Train to ``steps`` total, resuming from ``directory`` when it holds a checkpoint.

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
        start_step = checkpointer.restore() or 0
    result = TrainResult(steps, start_step, 0.0, restored_from=start_step or None)
    stream = batches(workload)
    begin = time.perf_counter()
    try:
        for step in range(start_step + 1, steps + 1):
            result.losses.append(workload.train_step(next(stream)))
            if checkpointer is not None:
                checkpointer.maybe_save(step)
            if progress is not None:
                progress(step)
        if checkpointer is not None:
            checkpointer.wait()
    finally:
        result.seconds = time.perf_counter() - begin
        if checkpointer is not None:
            checkpointer.close()
    return result, checkpointer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pcframe training child process")
    parser.add_argument("--directory", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--workload-args", default="{}", help="JSON kwargs of the workload")
    parser.add_argument("--engine-args", default="{}", help="JSON EngineConfig overrides")
    parser.add_argument("--final", help="write final parameters + optimizer state here")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    workload = build(args.workload, **json.loads(args.workload_args))

    def progress(step: int) -> None:
        print(f"step {step}", flush=True)

    result, _ = train(
        workload,
        args.steps,
        args.directory,
        FixedSteps(args.every),
        EngineConfig(**json.loads(args.engine_args)),
        progress,
    )
    print(f"done start={result.start_step} steps={result.steps}", flush=True)
    if args.final:
        from safetensors.torch import save_file

        tensors = {f"model/{k}": v.contiguous() for k, v in workload.model.state_dict().items()}
        for index, state in workload.optimizer.state_dict()["state"].items():
            for key, value in state.items():
                tensors[f"optimizer/{index}/{key}"] = value.reshape(-1).contiguous()
        save_file(tensors, args.final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
