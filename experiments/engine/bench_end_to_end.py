"""End to end: how much slower the built-in GPT workload trains with pcframe checkpointing.

Real compute on CPU (the ``gpt`` workload of ``conf/workload/gpt.yaml``: 3.7 M parameters,
a 44 MB checkpoint with AdamW's moments; torch threads from ``threads: auto``, which leaves
one core to the engine), the engine's defaults, a checkpoint every ``--intervals`` steps.

Design (the tuner's own A/B measurement, :func:`pcframe.apps.tuning.measure.measure`, with
``timed_drain=False``): pairs of segments of ``--steps`` training steps, one without
checkpoints (A) and one with them (B), back to back in the same process, in the order AB BA
AB ... . Slowdown per
pair = B's time / A's time - 1; reported as the median and the mean with its 95 %
confidence interval (Student t over pairs). In B the saves fall at steps ``interval // 2``
mod ``interval`` of the segment, so the last one's write overlaps the segment's tail like
any other, and every save is durable before the next segment starts (waited for, untimed):
no segment inherits another's writes. A pair is ~2 x steps x step time, so slow drift of a
shared machine cancels in its ratio; a burst spoils one pair, which the median ignores.

Published anchors (their hardware, not re-measured here): PCcheck (ASPLOS '25) < 3 %
slowdown checkpointing every 10 iterations on an A100; LowDiff < 3.1 % checkpointing every
iteration; Checkmate matches no-checkpoint throughput (it checkpoints from gradients on the
network path).

Run:  python experiments/engine/bench_end_to_end.py --out experiments/results/end_to_end_cpu.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from scipy import stats

from pcframe.apps.machine import resolve_threads, usable_cpus
from pcframe.apps.tuning.measure import measure
from pcframe.apps.workloads import build
from pcframe.config import EngineConfig

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results


def run(interval: int, steps: int, pairs: int, directory: Path) -> dict:
    """The tuner's A/B measurement (pcframe.apps.tuning.measure) of the default engine,
    training time only (``timed_drain=False``)."""
    result = measure(
        build("gpt"),
        EngineConfig(),
        directory,
        interval=interval,
        steps=steps,
        repeats=pairs,
        timed_drain=False,
    )
    pairs_ = zip(result.baseline_step, result.checkpoint_step, strict=True)
    slowdowns = [b / a - 1 for a, b in pairs_]
    mean = statistics.fmean(slowdowns)
    low, high = stats.t.interval(0.95, len(slowdowns) - 1, loc=mean, scale=stats.sem(slowdowns))
    return {
        "interval": interval,
        "step_ms": statistics.median(result.baseline_step) * 1000,
        "slowdowns": slowdowns,
        "median": statistics.median(slowdowns),
        "mean": mean,
        "ci": (low, high),
        "stall_ms": statistics.median(result.stalls) * 1000,
        "durable_ms": statistics.median(result.durable) * 1000,
        "committed": len(result.durable),
        "saves": pairs * (steps // interval),
        "nbytes": result.checkpoint_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals", type=int, nargs="+", default=[10, 1])
    parser.add_argument("--steps", type=int, default=60, help="steps per segment")
    parser.add_argument("--pairs", type=int, default=7, help="A/B pairs per interval (>= 5)")
    parser.add_argument("--out", default="experiments/results/end_to_end_cpu.md")
    args = parser.parse_args()
    threads = resolve_threads("auto")
    torch.set_num_threads(threads)
    results = []
    for interval in args.intervals:
        with tempfile.TemporaryDirectory(prefix="pcframe-e2e-", dir="/var/tmp") as directory:
            results.append(run(interval, args.steps, args.pairs, Path(directory)))
        r = results[-1]
        print(f"every {interval}: median {r['median']:+.2%}, mean {r['mean']:+.2%}", flush=True)
    command = (
        "python experiments/engine/bench_end_to_end.py --intervals "
        f"{' '.join(map(str, args.intervals))} --steps {args.steps} --pairs {args.pairs} "
        f"--out {args.out}"
    )
    title = "End to end: training slowdown of the GPT workload with pcframe (CPU)"
    lines = [
        *header(title, command),
        f"Workload `gpt` (conf/workload/gpt.yaml), {results[0]['nbytes'] / 1e6:.0f} MB per "
        f"checkpoint; {threads} torch thread(s) of {usable_cpus()} usable CPUs "
        "(`threads: auto`); engine defaults. "
        f"{args.pairs} A/B pairs of {args.steps} steps per interval (see the script's "
        "docstring for the design).",
        "",
    ]
    rows = []
    for r in results:
        low, high = r["ci"]
        rows.append(
            [
                f"{r['interval']} steps",
                f"{r['step_ms']:.1f}",
                f"{r['median']:+.2%}",
                f"{r['mean']:+.2%} [{low:+.2%}, {high:+.2%}]",
                f"{r['stall_ms']:.2f}",
                f"{r['durable_ms']:.0f}",
                f"{r['committed']}/{r['saves']}",
                ", ".join(f"{s:+.1%}" for s in r["slowdowns"]),
            ]
        )
    columns = ["checkpoint every", "step (ms)", "slowdown median", "mean [95 % CI]"]
    columns += ["stall / ckpt (ms)", "durable (ms)", "committed", "per-pair slowdowns"]
    lines += table_lines(columns, rows, align="rrrrrrrl")
    lines += [
        "",
        "Published anchors (their hardware): PCcheck < 3 % at every 10 iterations (A100); "
        "LowDiff < 3.1 % at every iteration; Checkmate: no-checkpoint throughput.",
    ]
    write_results(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
