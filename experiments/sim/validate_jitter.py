"""The validation replays once more, predicted with restart-time jitter (no new replay).

``validate_replay.py`` predicts each replay with one restart time, so every kill falls at
one exact phase relative to the checkpoints. With a long interval that phase decides each
kill's lost work (0 to a whole interval), and a few tens of milliseconds of restart time
move it. Real restarts jitter by about that much (``restart_samples_s`` and
``restart_in_replay_s`` in ``sim_validation.csv``). This reads the committed replays and
their calibrated inputs from that CSV and predicts each replay as the mean over restart
times spread evenly within ±``--spread`` seconds of the calibrated one: the expected
goodput when restarts jitter, next to the single-phase prediction.

    python experiments/sim/validate_jitter.py
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
from pathlib import Path

import numpy as np
from common import RESULTS, header
from validate_replay import simulate_kills

from pcframe.apps.preemption import resolve_trace, trace_times
from pcframe.sim import JobSpec
from pcframe.sim.report import markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", default=str(RESULTS / "sim_validation.csv"))
    parser.add_argument("--trace", default="pccheck/gpus_trace.csv")
    parser.add_argument("--compression", type=float, default=15.0)
    parser.add_argument("--spread", type=float, default=0.1, help="± seconds of restart time")
    parser.add_argument("--points", type=int, default=21)
    parser.add_argument("--out", default=str(RESULTS / "sim_validation_jitter.md"))
    args = parser.parse_args()
    with open(args.csv) as f:
        replays = [r for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    kills = trace_times(resolve_trace(args.trace), compression=args.compression)
    rows = []
    for replay in (r for r in replays if r["offset_s"] != "mean"):
        every, steps = int(replay["every"]), int(replay["steps"])
        offset = float(replay["offset_s"])
        iteration = float(replay["iteration_ms"]) / 1e3
        job = JobSpec(
            iteration_time=iteration,
            save_stall=float(replay["stall_ms"]) / 1e3,
            save_duration=float(replay["durable_ms"]) / 1e3,
            restart_cost=float(replay["restart_s"]) - iteration,
            max_in_flight=int(replay["in_flight"]),
            total_steps=steps,
            final_save=True,
        )
        shifted = [k - offset for k in kills if k > offset]
        deltas = np.linspace(-args.spread, args.spread, args.points)
        goodputs = [
            simulate_kills(
                dataclasses.replace(job, restart_cost=job.restart_cost + d), every, shifted, steps
            ).goodput
            for d in deltas
        ]
        measured = float(replay["goodput_measured"])
        point = float(replay["goodput_predicted"])
        jittered = statistics.fmean(goodputs)
        rows.append(
            {
                "every": every,
                "in_flight": int(replay["in_flight"]),
                "offset_s": replay["offset_s"],
                "goodput_measured": measured,
                "predicted_one_phase": point,
                "error_one_phase_pct": 100 * (point / measured - 1),
                "predicted_jittered": jittered,
                "error_jittered_pct": 100 * (jittered / measured - 1),
                "jittered_min": min(goodputs),
                "jittered_max": max(goodputs),
            }
        )
    for every in sorted({r["every"] for r in rows}):
        group = [r for r in rows if r["every"] == every]
        measured = statistics.fmean(r["goodput_measured"] for r in group)
        point = statistics.fmean(r["predicted_one_phase"] for r in group)
        jittered = statistics.fmean(r["predicted_jittered"] for r in group)
        rows.append(
            dict(
                group[0],
                offset_s="mean",
                goodput_measured=measured,
                predicted_one_phase=point,
                error_one_phase_pct=100 * (point / measured - 1),
                predicted_jittered=jittered,
                error_jittered_pct=100 * (jittered / measured - 1),
                jittered_min=min(r["jittered_min"] for r in group),
                jittered_max=max(r["jittered_max"] for r in group),
            )
        )
    rows.sort(key=lambda r: (r["every"], r["offset_s"] == "mean"))
    text = header(
        "Validation with restart-time jitter in the prediction",
        f"The replays of `sim_validation.md` (same measured goodput, same calibrated inputs), "
        f"predicted as the mean over {args.points} restart times evenly spread within "
        f"±{args.spread:g} s of the calibrated one (the range of restart times measured on "
        "this machine: `restart_samples_s`, `restart_in_replay_s`). `jittered_min`/`max`: "
        "the range of the single-restart-time predictions inside that spread, i.e. how much "
        "a prediction that fixes one phase can swing.",
    )
    columns = [
        "every",
        "in_flight",
        "offset_s",
        "goodput_measured",
        "predicted_one_phase",
        "error_one_phase_pct",
        "predicted_jittered",
        "error_jittered_pct",
        "jittered_min",
        "jittered_max",
    ]
    text += markdown_table(rows, columns, digits=2)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
