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
   interval policy; goodput = steps / wall seconds to the end of the job. The prediction
   is the mean over ``--draws`` seeds of runs whose restart and step times are drawn with
   the spread measured in step 1 (``JobSpec.restart_jitter``, ``iteration_jitter``): with
   long intervals a fixed phase decides whether each kill lands just before or just after
   a checkpoint, and the kill gaps (which shifting does not change) repeat that luck.

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
from common import RESULTS, csv_header, header, write_results
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
# Floors of the measured spreads: a handful of samples can agree by chance.
MIN_RESTART_JITTER = 0.05
MIN_ITERATION_JITTER = 0.005
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
    # The children's stderr is kept next to their checkpoints: a child that fails says why.
    logs = directory.with_name(directory.name + "-logs")
    run = Supervisor(spec, kills, timeout=3600.0, on_line=on_line, log_dir=logs).run()
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
    steps = int(55.0 / iteration_time)
    run, timeline = supervised(args, every, n, [10.0, 20.0, 30.0, 40.0], root / "restart", steps)
    shutil.rmtree(root / "restart", ignore_errors=True)
    samples = run.restart_seconds
    # A sample ends with the first step trained; the simulator adds that step itself.
    restart = max(statistics.fmean(samples) - iteration_time, 0.0)
    # The step time of the loop as the replay runs it: the supervised child with the engine
    # in the loop, printing each step, at this interval (the bare in-process loop above is
    # ~0.5 % faster, and at long intervals that moves checkpoints across kills). Its spread
    # over lives (and over the bare runs) is the jitter of the prediction.
    lives = life_step_times(timeline)
    if lives:
        iteration_time = statistics.fmean(lives)
    per_life = [r.seconds / r.steps for r in runs] + lives
    return {
        "iteration_time": iteration_time,
        "iteration_bare": statistics.fmean(r.seconds / r.steps for r in runs),
        "records": records,
        "restart": restart,
        "restart_samples": samples,
        "restart_jitter": max(statistics.stdev(samples), MIN_RESTART_JITTER),
        "iteration_jitter": max(
            statistics.stdev(per_life) / statistics.fmean(per_life), MIN_ITERATION_JITTER
        ),
    }


def life_step_times(timeline: list[tuple[float, int]], min_steps: int = 20) -> list[float]:
    """Mean step time of each life of a supervised run (a life: steps counting up)."""
    out, life = [], []
    for t, step in timeline:
        if life and step <= life[-1][1]:
            out.append(life)
            life = []
        life.append((t, step))
    out.append(life)
    return [
        (life[-1][0] - life[0][0]) / (life[-1][1] - life[0][1])
        for life in out
        if len(life) > min_steps
    ]


def predict(
    cal: dict[str, Any], every: int, n: int, kills: list[float], steps: int, draws: int = 0
) -> Any:
    """The calibrated job and its prediction: one fixed phase (``draws=0``), or the mean
    goodput over ``draws`` seeds with the calibrated restart and step-time spread."""
    job = job_from_records(
        cal["records"],
        cal["iteration_time"],
        cal["restart"],
        max_in_flight=n,
        total_steps=steps,
        final_save=True,
    )
    if not draws:
        return job, simulate_kills(job, every, kills, steps)
    jittered = dataclasses.replace(
        job, restart_jitter=cal["restart_jitter"], iteration_jitter=cal["iteration_jitter"]
    )
    runs = [simulate_kills(jittered, every, kills, steps, seed) for seed in range(draws)]
    return jittered, runs


def simulate_kills(job: Any, every: int, kills: list[float], steps: int, seed: int = 0) -> Any:
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
    return simulate(trace, P.FixedSteps(every), job, options=SimOptions(seed=seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="pccheck/gpus_trace.csv")
    parser.add_argument("--compression", type=float, default=15.0)
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["50:2", "200:1", "300:1"],
        help="every:in_flight pairs",
    )
    parser.add_argument(
        "--draws", type=int, default=48, help="seeds of the jittered prediction (its mean)"
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
                _, before = predict(cal, every, n, shifted, args.steps, args.draws)
                # The model check: the same prediction from this replay's own restart and
                # step times (their means and spread), which the load of this shared
                # 2-core machine moves by seconds and percents between runs.
                own = measured_inputs(cal, run, timeline)
                _, draws = predict(own, every, n, shifted, args.steps, args.draws)
                per_offset.append(
                    row(args, every, n, offset, cal, own, job, run, sim, before, draws)
                )
                if offset == args.offsets[0]:
                    wall = statistics.fmean(d.wall_seconds for d in draws)
                    timelines[f"every {every}, N={n}"] = (timeline, wall, shifted)
                print({k: per_offset[-1][k] for k in ("every", "offset_s", "error_pct")})
            rows += per_offset
            if len(per_offset) > 1:
                rows.append(mean_row(per_offset))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_outputs(args, rows, timelines)


def measured_inputs(cal: dict[str, Any], run: Any, timeline: list) -> dict[str, Any]:
    """The calibration with restart and step time (mean, spread) as measured in ``run``."""
    lives = life_step_times(timeline)
    it = statistics.fmean(lives) if lives else cal["iteration_time"]
    samples = run.restart_seconds or cal["restart_samples"]
    return dict(
        cal,
        iteration_time=it,
        restart=max(statistics.fmean(samples) - it, 0.0),
        restart_samples=samples,
        restart_jitter=max(
            statistics.stdev(samples) if len(samples) > 1 else 0.0, MIN_RESTART_JITTER
        ),
        iteration_jitter=max(
            statistics.stdev(lives) / it if len(lives) > 1 else 0.0, MIN_ITERATION_JITTER
        ),
    )


def row(args, every, n, offset, cal, own, job, run, sim, before, draws) -> dict[str, Any]:
    measured = args.steps / run.wall
    goodputs = [d.goodput for d in draws]
    predicted = statistics.fmean(goodputs)
    calibrated = statistics.fmean(d.goodput for d in before)
    return {
        "every": every,
        "in_flight": n,
        "offset_s": f"{offset:g}",
        "steps": args.steps,
        "goodput_measured": measured,
        "goodput_predicted": predicted,
        "error_pct": 100.0 * (predicted / measured - 1.0),
        "predicted_p10": float(np.percentile(goodputs, 10)),
        "predicted_p90": float(np.percentile(goodputs, 90)),
        "goodput_one_phase": sim.goodput,
        "error_one_phase_pct": 100.0 * (sim.goodput / measured - 1.0),
        "goodput_calibrated": calibrated,
        "error_calibrated_pct": 100.0 * (calibrated / measured - 1.0),
        "wall_measured_s": run.wall,
        "wall_predicted_s": statistics.fmean(d.wall_seconds for d in draws),
        "kills_measured": run.kills,
        "kills_predicted": statistics.fmean(d.preemptions for d in draws),
        "lost_steps_measured": run.lost_steps,
        "lost_steps_predicted": statistics.fmean(d.lost_steps for d in draws),
        "iteration_ms": 1e3 * own["iteration_time"],
        "iteration_calibrated_ms": 1e3 * cal["iteration_time"],
        "stall_ms": 1e3 * job.save_stall,
        "durable_ms": 1e3 * job.save_duration,
        "restart_s": own["restart"] + own["iteration_time"],
        "restart_calibrated_s": cal["restart"] + cal["iteration_time"],
        "iteration_bare_ms": 1e3 * cal["iteration_bare"],
        "restart_jitter_s": own["restart_jitter"],
        "iteration_jitter_pct": 100.0 * own["iteration_jitter"],
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
        ("goodput_measured", "goodput_one_phase", "error_one_phase_pct"),
        ("goodput_measured", "goodput_calibrated", "error_calibrated_pct"),
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
        "`goodput_predicted` (the check of the simulator's model): the mean over "
        f"{args.draws} seeds of the simulator with each start's restart time and each "
        "process's step time drawn around the means measured in this replay, with their "
        "spread there (`restart_s`, `iteration_ms`, `restart_jitter_s`, "
        "`iteration_jitter_pct`; p10-p90 of the draws beside it), stall and time to durable "
        "from the calibration. `goodput_calibrated`: the same from inputs measured only "
        "before the replay (its error adds how far this shared machine's load moved between "
        "the calibration and the replay). `goodput_one_phase`: the old prediction, "
        "calibrated inputs and exactly one restart and step time (one phase of kills vs "
        "checkpoints). With several "
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
        "predicted_p10",
        "predicted_p90",
        "goodput_calibrated",
        "error_calibrated_pct",
        "goodput_one_phase",
        "error_one_phase_pct",
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
        "iteration_calibrated_ms",
        "iteration_bare_ms",
        "stall_ms",
        "durable_ms",
        "restart_s",
        "restart_calibrated_s",
        "restart_jitter_s",
        "iteration_jitter_pct",
        "restart_samples_s",
        "restart_in_replay_s",
    ]
    text += markdown_table(rows, cal, digits=2)
    write_results(out.with_suffix(".md"), text)
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
