"""Validation against reality: replay a trace's preemptions on a compressed clock with the
real engine, and compare the measured goodput with the simulator's prediction.

1. Calibrate first, on the same workload: the step time without checkpoints and the
   engine's own stall / time to durable per save (in-process runs of the same step
   function), and the restart cost from a supervised child SIGKILLed three times (from
   each kill to its successor's first step: process start, imports, restore, that step).
2. Replay: ``pcframe.apps.preemption.Supervisor`` (the project's preemption supervisor) runs the
   training child (``replay_child.py``: the real engine, a real model, each step with an
   accelerator-like sleep, see there), SIGKILLs it at the trace's preemption times divided
   by ``--compression`` and restarts it at once (the trace's VMs are relaunched as soon as
   possible) until ``--steps`` are trained.
3. Predict: the same kill times as a pcframe trace (up, except one 0.05 s tick at each
   kill) and the calibrated ``JobSpec`` through ``pcframe.sim.simulate`` with the same
   interval policy; goodput = steps / wall seconds to the end of the job.

    python experiments/sim/validate_replay.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import RESULTS, csv_header, header
from replay_child import accelerated

import pcframe.policies as P
from pcframe.apps.preemption import ChildSpec, Supervisor, resolve_trace, trace_times
from pcframe.apps.training import EVENT_PREFIX, train
from pcframe.apps.workloads import build
from pcframe.config import EngineConfig
from pcframe.policies.traces import Trace
from pcframe.sim import SimOptions, job_from_records, simulate
from pcframe.sim.report import markdown_table, write_csv

TICK = 0.05  # seconds per tick of the replayed trace given to the simulator
WORKLOAD = {"hidden": 512, "layers": 4, "samples": 8192}  # 10 MB of state with AdamW


@dataclasses.dataclass
class ReplayChild(ChildSpec):
    """The supervisor's child spec, running ``replay_child.py`` instead of the stock loop."""

    every: int = 50
    in_flight: int = 2
    accelerator_ms: float = 90.0

    def command(self, python: str = sys.executable) -> list[str]:
        return [
            python,
            str(Path(__file__).with_name("replay_child.py")),
            "--directory",
            self.directory,
            "--steps",
            str(self.steps),
            "--every",
            str(self.every),
            "--in-flight",
            str(self.in_flight),
            "--accelerator-ms",
            str(self.accelerator_ms),
            "--workload-args",
            json.dumps(self.workload_args),
        ]


def child(args: argparse.Namespace, directory: Path, steps: int, every: int, n: int) -> ChildSpec:
    return ReplayChild(
        directory=str(directory),
        steps=steps,
        workload="mlp",
        workload_args=WORKLOAD,
        threads=1,
        every=every,
        in_flight=n,
        accelerator_ms=args.accelerator_ms,
    )


def supervised(
    args: argparse.Namespace, every: int, n: int, kills: list[float], directory: Path, steps: int
) -> tuple[Any, list[tuple[float, int]]]:
    """A supervised child killed at ``kills``: the run and its (time, step) lines."""
    timeline: list[tuple[float, int]] = []
    start = time.monotonic()

    def on_line(index: int, line: str) -> None:
        if line.startswith("step "):
            timeline.append((time.monotonic() - start, int(line.split()[1])))
        elif line.startswith(EVENT_PREFIX):
            json.loads(line[len(EVENT_PREFIX) :])  # well-formed, or fail loudly

    spec = child(args, directory, steps, every, n)
    run = Supervisor(spec, kills, timeout=3600.0, on_line=on_line).run()
    return run, timeline


def calibrate(args: argparse.Namespace, every: int, n: int, root: Path) -> dict[str, Any]:
    """What the simulator needs, measured on this workload before the replay."""
    runs = [
        train(accelerated(build("mlp", **WORKLOAD), args.accelerator_ms), 100)[0] for _ in range(2)
    ]
    iteration_time = statistics.fmean(r.seconds / r.steps for r in runs)
    directory = root / f"calibrate-{every}-{n}"
    _, ckpt = train(
        accelerated(build("mlp", **WORKLOAD), args.accelerator_ms),
        max(4 * every, 200),
        directory,
        P.FixedSteps(every),
        EngineConfig(max_in_flight=n),
    )
    records = list(ckpt.records.values())
    shutil.rmtree(directory, ignore_errors=True)
    steps = int(45.0 / iteration_time)
    run, _ = supervised(args, every, n, [10.0, 20.0, 30.0], root / "restart", steps)
    shutil.rmtree(root / "restart", ignore_errors=True)
    samples = run.restart_seconds
    # A sample ends with the first step trained; the simulator adds that step itself.
    restart = max(statistics.fmean(samples) - iteration_time, 0.0)
    return {
        "iteration_time": iteration_time,
        "records": records,
        "restart": restart,
        "restart_samples": samples,
    }


def predict(cal: dict[str, Any], every: int, n: int, kills: list[float], steps: int) -> Any:
    job = job_from_records(
        cal["records"],
        cal["iteration_time"],
        cal["restart"],
        max_in_flight=n,
        total_steps=steps,
        final_save=True,
    )
    return job, simulate_kills(job, every, kills, steps)


def simulate_kills(job: Any, every: int, kills: list[float], steps: int) -> Any:
    """``job`` (restart cost as measured) under exactly these kill times, ``FixedSteps(every)``."""
    horizon = 4.0 * steps * job.iteration_time + 600.0
    up = np.ones(int(horizon / TICK), dtype=np.int64)
    for k in kills:
        tick = math.ceil(k / TICK)
        if tick < up.size:
            up[tick] = 0
    trace = Trace("replayed-kills", "replay", TICK, 1, up)
    # The outage tick is part of the measured restart time: take it out of the cost.
    job = dataclasses.replace(job, restart_cost=max(job.restart_cost - TICK, 0.0))
    return simulate(trace, P.FixedSteps(every), job, options=SimOptions())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="pccheck/gpus_trace.csv")
    parser.add_argument("--compression", type=float, default=15.0)
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument(
        "--configs", nargs="+", default=["50:2", "200:1"], help="every:in_flight pairs"
    )
    parser.add_argument("--accelerator-ms", type=float, default=90.0)
    parser.add_argument(
        "--offsets",
        nargs="+",
        type=float,
        default=[0.0, 7.0, 14.0],
        help="replay the kill schedule shifted earlier by these seconds, once each; the mean "
        "over shifts averages out where kills happen to fall between two checkpoints",
    )
    parser.add_argument("--nice", type=int, default=-10)
    parser.add_argument("--out", default=str(RESULTS / "sim_validation"))
    args = parser.parse_args()
    if args.nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # the children inherit it
        except PermissionError:
            print("could not raise the priority: measuring at normal priority")
    torch.set_num_threads(1)
    kills = trace_times(resolve_trace(args.trace), compression=args.compression)
    root = Path(tempfile.mkdtemp(prefix="pcframe-validate-", dir=Path.cwd()))
    rows, timelines = [], {}
    try:
        for config in args.configs:
            every, n = (int(x) for x in config.split(":"))
            cal = calibrate(args, every, n, root)
            per_offset = []
            for offset in args.offsets:
                shifted = [k - offset for k in kills if k > offset]
                directory = root / f"replay-{config}-{offset:g}"
                run, timeline = supervised(args, every, n, shifted, directory, args.steps)
                job, sim = predict(cal, every, n, shifted, args.steps)
                # Secondary: the same prediction with the restart time measured in the replay
                # itself (Python start-up swings by seconds with the shared machine's load).
                own = cal
                if run.restart_seconds:
                    restart = statistics.fmean(run.restart_seconds) - cal["iteration_time"]
                    own = dict(cal, restart=restart)
                _, sim_own = predict(own, every, n, shifted, args.steps)
                per_offset.append(row(args, every, n, offset, cal, job, run, sim, sim_own))
                if offset == args.offsets[0]:
                    timelines[f"every {every}, N={n}"] = (timeline, sim.wall_seconds, shifted)
                print({k: per_offset[-1][k] for k in ("every", "offset_s", "error_pct")})
            rows += per_offset
            if len(per_offset) > 1:
                rows.append(mean_row(per_offset))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_outputs(args, rows, timelines)


def row(args, every, n, offset, cal, job, run, sim, sim_own) -> dict[str, Any]:
    measured = args.steps / run.wall
    return {
        "every": every,
        "in_flight": n,
        "offset_s": f"{offset:g}",
        "steps": args.steps,
        "goodput_measured": measured,
        "goodput_predicted": sim.goodput,
        "error_pct": 100.0 * (sim.goodput / measured - 1.0),
        "goodput_predicted_own_restarts": sim_own.goodput,
        "error_own_restarts_pct": 100.0 * (sim_own.goodput / measured - 1.0),
        "wall_measured_s": run.wall,
        "wall_predicted_s": sim.wall_seconds,
        "kills_measured": run.kills,
        "kills_predicted": sim.preemptions,
        "lost_steps_measured": run.lost_steps,
        "lost_steps_predicted": sim.lost_steps,
        "iteration_ms": 1e3 * job.iteration_time,
        "stall_ms": 1e3 * job.save_stall,
        "durable_ms": 1e3 * job.save_duration,
        "restart_s": cal["restart"] + cal["iteration_time"],
        "restart_samples_s": " ".join(f"{s:.2f}" for s in cal["restart_samples"]),
        "restart_in_replay_s": (
            statistics.fmean(run.restart_seconds) if run.restart_seconds else math.nan
        ),
    }


def mean_row(rows: list[dict]) -> dict[str, Any]:
    """Means over the shifted replays of one configuration; errors of the means."""
    out = dict(rows[0], offset_s="mean")
    fixed = ("every", "in_flight", "steps")
    numeric = [k for k, v in rows[0].items() if isinstance(v, int | float) and k not in fixed]
    for key in numeric:
        out[key] = statistics.fmean(r[key] for r in rows)
    for measured, predicted, error in (
        ("goodput_measured", "goodput_predicted", "error_pct"),
        ("goodput_measured", "goodput_predicted_own_restarts", "error_own_restarts_pct"),
    ):
        out[error] = 100.0 * (out[predicted] / out[measured] - 1.0)
    out["restart_samples_s"] = ""
    return out


def write_outputs(args: argparse.Namespace, rows: list[dict], timelines: dict) -> None:
    out = Path(args.out)
    write_csv(rows, out.with_suffix(".csv"), header=csv_header())
    gap = statistics.fmean(
        np.diff([0.0, *trace_times(resolve_trace(args.trace), None, args.compression)])
    )
    text = header(
        "Validation: simulator vs a real replay with SIGKILLs",
        f"Trace `{args.trace}` compressed {args.compression:g}x: its preemptions become "
        f"SIGKILLs every {gap:.0f} s of wall time on average, each followed by an immediate "
        f"restart. Training child: the real engine and a real MLP (10 MB of state) whose "
        f"steps also sleep {args.accelerator_ms:g} ms for the accelerator (see "
        f"`replay_child.py`), `FixedSteps(every)`, N in flight, {args.steps} steps. "
        "`goodput_predicted` uses only inputs measured before the replay; "
        "`..._own_restarts` takes the restart time measured during the replay instead "
        "(process start-up on this shared 2-core machine varies by seconds). With several "
        f"offsets ({', '.join(f'{o:g}' for o in args.offsets)} s) the kill schedule is "
        "replayed shifted earlier by each, and the `mean` row compares the mean measured "
        "goodput with the mean prediction: with long intervals a single replay's lost work "
        "depends on where a handful of kills fall between two checkpoints.",
    )
    cols = [
        "every",
        "in_flight",
        "offset_s",
        "goodput_measured",
        "goodput_predicted",
        "error_pct",
        "goodput_predicted_own_restarts",
        "error_own_restarts_pct",
        "wall_measured_s",
        "wall_predicted_s",
        "kills_measured",
        "kills_predicted",
        "lost_steps_measured",
        "lost_steps_predicted",
    ]
    text += markdown_table(rows, cols, digits=2)
    text += "\nInputs of the simulator (calibrated before the replay):\n\n"
    cal = [
        "every",
        "in_flight",
        "offset_s",
        "iteration_ms",
        "stall_ms",
        "durable_ms",
        "restart_s",
        "restart_samples_s",
        "restart_in_replay_s",
    ]
    text += markdown_table(rows, cal, digits=2)
    out.with_suffix(".md").write_text(text)
    _plot(timelines, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')}")


def _plot(timelines: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for i, (name, (timeline, predicted_end, kills)) in enumerate(timelines.items()):
        if not timeline:
            continue
        xs, ys = zip(*timeline, strict=True)
        line = ax.plot(xs, ys, lw=1, label=f"{name}: measured progress")[0]
        ax.axvline(
            predicted_end, color=line.get_color(), ls="--", lw=1, label=f"{name}: predicted end"
        )
        if i == 0:
            for k in kills:
                if k <= max(xs):
                    ax.axvline(k, color="grey", alpha=0.25, lw=0.8)
    ax.set_xlabel("wall seconds (grey: SIGKILLs)")
    ax.set_ylabel("training step reached")
    ax.set_title("Replay with real kills vs simulator prediction")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
