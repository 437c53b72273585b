"""The training process of the validation replay: ``pcframe.apps.training`` with an
accelerator-like step.

A real model (the MLP of ``pcframe.apps.workloads``) trains for real with the real engine
(``Checkpointer``: gated snapshot, background persist, commit, restore after SIGKILL), but
each step first sleeps ``--accelerator-ms``, standing for forward/backward on a GPU, as the
engine benchmark does. On a shared 2-core machine a CPU-bound step swings by 20-40 % with
other users' load; this keeps the step time, which the simulator takes as a constant, stable
enough to judge the simulator's event model. It prints what ``python -m pcframe.apps.training``
prints (``step N``, ``pcframe-event`` lines), so ``pcframe.apps.preemption.Supervisor`` runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from pcframe.apps.training import emit, train
from pcframe.apps.workloads import Workload, build
from pcframe.config import EngineConfig
from pcframe.feed import process_age
from pcframe.policies import FixedSteps


def accelerated(workload: Workload, sleep_ms: float) -> Workload:
    """``workload`` whose every step first waits ``sleep_ms`` (the accelerator's share)."""
    real_step = workload.train_step

    def step(batch: Any) -> float:
        time.sleep(sleep_ms / 1e3)
        return real_step(batch)

    workload.train_step = step  # type: ignore[method-assign]
    return workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--directory", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--in-flight", type=int, default=2)
    parser.add_argument("--accelerator-ms", type=float, default=90.0)
    parser.add_argument("--workload-args", default="{}")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    workload = accelerated(build("mlp", **json.loads(args.workload_args)), args.accelerator_ms)
    first = True

    def progress(step: int) -> None:
        nonlocal first
        if first:
            first = False
            emit("first_step", step=step, age=process_age())
        print(f"step {step}", flush=True)

    result, ckpt = train(
        workload,
        args.steps,
        args.directory,
        FixedSteps(args.every),
        EngineConfig(max_in_flight=args.in_flight),
        progress,
        on_restored=lambda step, seconds: emit(
            "restored", step=step or 0, seconds=seconds, age=process_age()
        ),
        # When each version became durable: the validation compares these instants with the
        # simulator's (a kill loses everything after the newest commit, not the newest save).
        on_commit=lambda count, step: emit("committed", step=step, age=process_age()),
    )
    records = [r for r in ckpt.records.values() if r.status == "committed"]
    emit(
        "done",
        start=result.start_step,
        steps=result.steps,
        seconds=result.seconds,
        checkpoints=len(records),
        stall=sum(r.stall for r in records),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
