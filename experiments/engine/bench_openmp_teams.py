"""Training step time while an engine is alive: the OpenMP-team effect (pcframe.runtime.threads).

Trains the built-in GPT workload with 2 torch threads and times segments of steps in
three conditions, round-robin so machine load hits all alike:

* ``no engine``: plain training;
* ``engine``: a Checkpointer that has saved once and sits idle (its threads limited to
  one OpenMP thread each, as shipped);
* ``engine, threads not limited``: the same with ``single_threaded_torch`` disabled, i.e.
  the engine before the fix, whose copy thread's torch ops made a second OpenMP team.

No checkpoint is taken during the timed segments, so any difference is the engine's
presence alone. Reports the median step time and its ratio to ``no engine``.

    python experiments/engine/bench_openmp_teams.py --rounds 5 \\
        --out experiments/results/engine_openmp_teams.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import pcframe.save.pipeline
from pcframe import Checkpointer, EngineConfig
from pcframe.apps.training import batches
from pcframe.apps.workloads import build
from pcframe.policies import FixedSteps

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

GPT: dict = {}  # the defaults of conf/workload/gpt.yaml: 3.7 M parameters


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40, help="steps per timed segment")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    workload = build("gpt", **GPT)
    stream = batches(workload)

    def segment() -> float:
        begin = time.perf_counter()
        for _ in range(args.steps):
            workload.train_step(next(stream))
        return (time.perf_counter() - begin) / args.steps

    def with_engine(limited: bool) -> float:
        original = pcframe.save.pipeline.single_threaded_torch
        if not limited:
            pcframe.save.pipeline.single_threaded_torch = lambda: None
        try:
            with (
                tempfile.TemporaryDirectory() as directory,
                Checkpointer(
                    directory,
                    model=workload.model,
                    optimizer=workload.optimizer,
                    policy=FixedSteps(10**9),
                    config=EngineConfig(copy_backend="torch"),
                ) as ckpt,
            ):
                ckpt.save(0).wait()
                return segment()
        finally:
            pcframe.save.pipeline.single_threaded_torch = original

    conditions = {
        "no engine": segment,
        "engine (as shipped)": lambda: with_engine(True),
        "engine, threads not limited (before the fix)": lambda: with_engine(False),
    }
    segment()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in conditions}
    for r in range(args.rounds):
        for name, run in conditions.items():
            times[name].append(run())
            print(f"round {r} {name:46s} {1e3 * times[name][-1]:6.1f} ms/step", flush=True)
    base = statistics.median(times["no engine"])
    command = "python experiments/engine/bench_openmp_teams.py " + " ".join(sys.argv[1:])
    lines = [
        *header("Training step time with an idle engine alive (OpenMP teams)", command),
        f"GPT workload (conf/workload/gpt.yaml), torch {torch.__version__}, "
        f"{args.threads} torch threads, "
        f"{os.cpu_count()} CPUs; {args.rounds} rounds of {args.steps} steps per condition, "
        f"round-robin; load average at the end {os.getloadavg()[0]:.1f}.",
        "",
    ]
    rows = []
    for name, values in times.items():
        med = statistics.median(values)
        low_high = f"{1e3 * min(values):.1f} – {1e3 * max(values):.1f}"
        rows.append([name, f"{1e3 * med:.1f}", low_high, f"{med / base:.2f}"])
    columns = ["condition", "step time (ms, median)", "min – max", "÷ no engine"]
    lines += table_lines(columns, rows, align="lrlr")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_results(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
