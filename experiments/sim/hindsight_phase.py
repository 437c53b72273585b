"""How much of the hindsight-best fixed interval is phase luck.

Experiment 5 divides every policy's goodput by that of the best ``FixedSteps`` interval
found in hindsight on each trace. On traces where a few long lives dominate, that best
interval can win by having a checkpoint land just before the preemption that ends a long
life, and an interval a few percent off does much worse: no online policy can know that
phase. This script measures it: for every shipped trace and both regimes it simulates the
hindsight-best ``every`` scaled by a few factors, takes the median over the +-10 % window
("hindsight, phase-averaged") and sets the shipped preemption-aware policy (experiment 5's
``pa()``, leave one zone out) against both yardsticks.

    python experiments/sim/hindsight_phase.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from common import RESULTS, header, write_results
from exp5_loo_hindsight import pa
from loo import fixed_curves, history_for, key_of
from profiles import job_for

import pcframe.policies as P
from pcframe.policies.traces import Trace, load_traces, shared_traces_dir
from pcframe.sim import simulate
from pcframe.sim.report import markdown_table

FACTORS = (0.80, 0.90, 0.95, 0.98, 1.02, 1.05, 1.10, 1.20)
WINDOW = (0.90, 1.10)  # the phase-averaged yardstick: median over these factors and 1.0
GOOD = 0.995


def trace_row(regime: str, trace: Trace, traces: list[Trace], best: float, every: int) -> dict:
    """Goodput at each scaled interval relative to the best, and PA against both yardsticks."""
    job = job_for(trace, regime)
    rel = {
        f: simulate(trace, P.FixedSteps(max(1, round(every * f))), job).goodput / best
        for f in FACTORS
    }
    window = [1.0] + [x for f, x in rel.items() if WINDOW[0] <= f <= WINDOW[1]]
    phase = statistics.median(window)
    pa_goodput = simulate(trace, pa(trace, history_for(trace, traces)), job).goodput
    return {
        "trace": trace.name if trace.capacity == 1 else f"{trace.name} ({trace.capacity})",
        "hindsight goodput": best,
        "hindsight s": every * job.step_time(trace.capacity),
        **{f"x{f:.2f}": x for f, x in rel.items()},
        "phase-avg / best": phase,
        "PA / best": pa_goodput / best,
        "PA / phase-avg": pa_goodput / (best * phase),
    }


def summary(rows: list[dict[str, Any]]) -> str:
    table = []
    for col in ("PA / best", "PA / phase-avg", "phase-avg / best"):
        xs = [r[col] for r in rows]
        table.append(
            {
                "ratio": col,
                "mean": statistics.fmean(xs),
                "min": min(xs),
                f"traces >= {GOOD}": f"{sum(x >= GOOD for x in xs)} / {len(xs)}",
            }
        )
    return markdown_table(table, list(table[0]), digits=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--regimes", nargs="+", default=["async", "sync"])
    parser.add_argument("--cache", default=None, help="JSON cache of the fixed-interval runs")
    parser.add_argument("--out", default=str(RESULTS / "sim_hindsight_phase.md"))
    args = parser.parse_args()
    start = time.perf_counter()
    traces = load_traces(shared_traces_dir())
    curves = fixed_curves(traces, args.regimes, args.cache)
    text = header(
        "Hindsight-best fixed interval: how much is phase luck",
        "For each shipped trace (job presets and hindsight search as in experiment 5), the "
        "hindsight-best `FixedSteps(every)` is re-run at `every` times each factor (rounded, "
        "at least 1 step); columns `x0.80`..`x1.20` are goodput relative to the best. "
        "`phase-avg`: the median goodput over the factors 0.90..1.10 and 1.0, i.e. the best "
        "interval without knowing the phase of the preemptions. `PA`: experiment 5's shipped "
        "`PreemptionAware` (leave one zone out), re-simulated here.",
    )
    for regime in args.regimes:
        rows = []
        for trace in traces:
            key = f"{regime}|{key_of(trace)}"
            best, every = curves.hindsight[key], curves.hindsight_every[key]
            rows.append(trace_row(regime, trace, traces, best, every))
        text += f"## {regime} checkpoints\n\n{summary(rows)}\n\nPer trace:\n\n"
        text += markdown_table(rows, list(rows[0]), digits=4) + "\n\n"
    write_results(args.out, text)
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
