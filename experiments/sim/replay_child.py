"""The training process of the validation replay: ``pcframe.apps.training`` with an
accelerator-like step.

A real model (the MLP of ``pcframe.apps.workloads``) trains for real with the real engine
(``Checkpointer``: gated snapshot, background persist, commit, restore after SIGKILL), but
each step first sleeps ``--accelerator-ms``, standing for forward/backward on a GPU, as the
engine benchmark does. On a shared 2-core machine a CPU-bound step swings by 20-40 % with
other users' load; this keeps the step time, which the simulator takes as a constant, stable
enough to judge the simulator's event model. It prints what ``python -m pcframe.apps.training``
prints (``step N``, ``pcframe-event`` lines), so ``pcframe.apps.preemption.Supervisor`` runs it.

``--paced``, ``--vms``, ``--scaling`` and ``--stop-file`` serve the real-kills replay
(``real_kills.py``): a paced step that shrinks with the VMs the process stands for, and a
planned stop (a change of VMs) that saves, drains and exits with a ``done`` line.

``--config`` names the interval policy (``replay_setup.Config``: ``fixed:EVERY:N``, ``pa:N``,
``notice:N``, ``checkfreq:N``), built by ``replay_setup.make_policy`` as the simulator's
prediction builds it; the engine asks it at every step. ``--notice-file``: the notice-driven
policy reads preemption notices from this file (``FileNoticeSource``), which the validation
writes ``--notice-lead`` seconds before each kill.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from replay_setup import NOTICE_MARGIN, Config, make_policy

from pcframe.apps.training import emit, train
from pcframe.apps.workloads import Workload, build
from pcframe.config import EngineConfig
from pcframe.feed import process_age
from pcframe.policies import FileNoticeSource
from pcframe.sim import JobSpec


def accelerated(workload: Workload, sleep_ms: float, paced: bool = False) -> Workload:
    """``workload`` whose every step first waits ``sleep_ms`` (the accelerator's share).

    ``paced``: each step instead starts ``sleep_ms`` after the one before it (at once if
    that one took longer), so the whole step (compute, the engine's per-step work, the
    progress line) takes ``sleep_ms`` whatever the machine's load, as long as it fits, and
    can be made to shrink as a data-parallel job's step does on more VMs (the real-kills
    replay runs a job of several VMs as one process)."""
    real_step = workload.train_step
    last_start: list[float] = []

    def step(batch: Any) -> float:
        if not paced:
            time.sleep(sleep_ms / 1e3)
            return real_step(batch)
        if last_start:
            time.sleep(max(0.0, last_start[0] + sleep_ms / 1e3 - time.perf_counter()))
        last_start[:] = [time.perf_counter()]
        return real_step(batch)

    workload.train_step = step  # type: ignore[method-assign]
    return workload


PACE_EVERY = 10  # steps between two "pace" events


def paced(workload: Workload) -> list[float]:
    """Times ``workload``'s steps: ``[steps, seconds]`` inside ``train_step`` in this process,
    reported as ``pace`` events. The step time between two ``step`` lines also holds the
    checkpoint stalls, which the simulator adds itself: the validation compares this compute
    time with the calibration's to see how the machine's load moved the step time."""
    real_step = workload.train_step
    pace = [0, 0.0]

    def step(batch: Any) -> float:
        t0 = time.perf_counter()
        loss = real_step(batch)
        pace[0] += 1
        pace[1] += time.perf_counter() - t0
        return loss

    workload.train_step = step  # type: ignore[method-assign]
    return pace


def policy_config(args: argparse.Namespace) -> Config:
    """``--config``, or ``fixed:EVERY:N`` from ``--every`` and ``--in-flight``."""
    return Config.parse(args.config or f"fixed:{args.every}:{args.in_flight}")


def policy_for(args: argparse.Namespace) -> Any:
    """The interval policy ``--config`` names, as the simulator's prediction builds it."""
    config = policy_config(args)
    source = None
    if config.notices and args.notice_file:
        source = FileNoticeSource(args.notice_file, window=args.notice_lead, poll_interval=0.0)
    return make_policy(config, args.mtbf, json.loads(args.priors), source, args.notice_margin)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--directory", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--in-flight", type=int, default=2)
    parser.add_argument("--accelerator-ms", type=float, default=90.0)
    parser.add_argument("--workload-args", default="{}")
    parser.add_argument("--config", default=None, help="the policy (default fixed:EVERY:N)")
    parser.add_argument("--mtbf", type=float, default=3600.0, help="PA's and Daly's MTBF")
    parser.add_argument("--priors", default="{}", help="cost priors of the policy (JSON)")
    parser.add_argument("--notice-file", default=None)
    parser.add_argument("--notice-lead", type=float, default=1.0)
    parser.add_argument(
        "--notice-margin", type=float, default=NOTICE_MARGIN, help="NoticeDriven's margin (s)"
    )
    parser.add_argument(
        "--paced", action="store_true", help="--accelerator-ms is the whole step, compute included"
    )
    parser.add_argument("--vms", type=int, default=1, help="VMs this process stands for")
    parser.add_argument("--scaling", type=float, default=1.0, help="data-parallel efficiency")
    parser.add_argument(
        "--stop-file", default=None, help="a planned stop: save, drain and exit when it exists"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # A job of several VMs steps faster, as the simulator's JobSpec.step_time says.
    step_ms = args.accelerator_ms / JobSpec(scaling_efficiency=args.scaling).speedup(args.vms)
    workload = accelerated(build("mlp", **json.loads(args.workload_args)), step_ms, args.paced)
    stop_file = Path(args.stop_file) if args.stop_file else None
    pace = paced(workload)
    first = True

    def progress(step: int) -> None:
        nonlocal first
        if first:
            first = False
            emit("first_step", step=step, age=process_age())
        print(f"step {step}", flush=True)
        if pace[0] % PACE_EVERY == 0:
            emit("pace", steps=pace[0], seconds=pace[1])

    result, ckpt = train(
        workload,
        args.steps,
        args.directory,
        policy_for(args),
        # The checkpoints in flight are the configuration's (``--in-flight`` without one).
        EngineConfig(max_in_flight=policy_config(args).in_flight),
        progress,
        on_restored=lambda step, seconds: emit(
            "restored", step=step or 0, seconds=seconds, age=process_age()
        ),
        # When each version became durable: the validation compares these instants with the
        # simulator's (a kill loses everything after the newest commit, not the newest save).
        on_commit=lambda count, step: emit("committed", step=step, age=process_age()),
        stop=(lambda step: stop_file.exists()) if stop_file else None,
    )
    records = [r for r in ckpt.records.values() if r.status == "committed"]
    emit(
        "done",
        start=result.start_step,
        steps=result.steps,
        seconds=result.seconds,
        checkpoints=len(records),
        stall=sum(r.stall for r in records),
        stopped=result.stopped_at,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
