"""What PA's inputs are worth: the preemption-aware policy given what it has to learn.

Issue 43, item 5 asks PA for >= 0.995x the seed-averaged hindsight best fixed interval on
every trace. Where it falls short, is it what PA learns, or what it cannot know? Two of
its inputs can be handed to it in the simulator:

* ``costs known``: the job's stall, time to durable, restart and step time as its priors
  (as shipped it plans with 1 s, 10 s, 60 s and 1 s until the job's first save is
  measured; a process that restores nothing starts from those again).
* ``whole history``: one policy object through the whole job (``SimOptions.policy_state=
  "process"``): it sees every preemption as it happens, instead of the state stored in
  the checkpoint it restores (what it learned after that checkpoint dies with the VM),
  and also the kills that come while a process restarts, which no engine process sees.

Each is simulated over the same 6 seeds of restart jitter as experiment 5 and divided by
that experiment's seed-averaged hindsight best (read from its CSV). ``PA`` (as shipped)
must reproduce experiment 5's PA column: a check that both ran the same simulation.

    python experiments/sim/pa_inputs.py --workers 2     # ~30 min here
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

from common import RESULTS, csv_header, header, write_results
from loo import history_for
from seeded import jittered_job

import pcframe.policies as P
from pcframe.policies.traces import Trace, load_traces, shared_traces_dir
from pcframe.sim import SimOptions, simulate
from pcframe.sim.report import markdown_table, write_csv

VARIANTS = ("PA", "PA costs known", "PA whole history", "PA both")
GOOD = 0.995
_TRACES: list[Trace] = []  # set before the pool forks


@dataclasses.dataclass(frozen=True)
class Task:
    regime: str
    trace: int
    variant: str
    seed: int


def _run(task: Task) -> tuple[Task, float]:
    trace = _TRACES[task.trace]
    job = jittered_job(trace, task.regime, 0.1)
    priors = {}
    if task.variant in ("PA costs known", "PA both"):
        priors = dict(
            stall_prior=job.save_stall,
            duration_prior=job.save_duration,
            restart_prior=job.restart_cost,
            iteration_prior=job.iteration_time,
        )
    policy = P.PreemptionAware(
        P.GammaPoissonRate.from_traces(history_for(trace, _TRACES)), **priors
    )
    whole = task.variant in ("PA whole history", "PA both")
    options = SimOptions(seed=task.seed, policy_state="process" if whole else "checkpoint")
    return task, simulate(trace, policy, job, options=options).goodput


def label(trace: Trace) -> str:
    """The trace's name in experiment 5's tables (a multi-VM trace: its VMs beside it)."""
    return trace.name if trace.capacity == 1 else f"{trace.name} ({trace.capacity})"


def hindsight(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    """Experiment 5's rows by (regime, trace key)."""
    with path.open() as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return {(r["regime"], f"{r['source']}|{r['trace']}"): r for r in rows}


def main() -> None:
    global _TRACES
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--regimes", nargs="+", default=["async", "sync"])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--traces", nargs="*", default=None, help="only these trace names")
    parser.add_argument("--exp5", default=str(RESULTS / "sim_exp5_loo_hindsight.csv"))
    parser.add_argument("--out", default=str(RESULTS / "sim_pa_inputs"))
    args = parser.parse_args()
    start = time.perf_counter()
    _TRACES = load_traces(shared_traces_dir())
    best = hindsight(Path(args.exp5))
    chosen = [i for i, t in enumerate(_TRACES) if not args.traces or t.name in args.traces]
    tasks = [
        Task(regime, i, variant, seed)
        for regime in args.regimes
        for i in chosen
        for variant in VARIANTS
        for seed in range(args.seeds)
    ]
    # The longest traces first, so the pool ends together.
    tasks.sort(key=lambda t: -_TRACES[t.trace].duration)
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        results = dict(pool.imap_unordered(_run, tasks, chunksize=1))
    rows = []
    for regime in args.regimes:
        for i in chosen:
            trace = _TRACES[i]
            ref = best[(regime, f"{trace.source}|{label(trace)}")]
            row: dict[str, Any] = {"regime": regime, "trace": ref["trace"]}
            for variant in VARIANTS:
                goodputs = [results[Task(regime, i, variant, s)] for s in range(args.seeds)]
                row[variant] = statistics.fmean(goodputs) / float(ref["hindsight"])
            row["PA in experiment 5"] = float(ref["PA"])
            rows.append(row)
    out = Path(args.out)
    write_csv(rows, out.with_suffix(".csv"), header=csv_header())
    write_results(out.with_suffix(".md"), report(rows, args))
    print(f"wrote {out.with_suffix('.md')} in {time.perf_counter() - start:.0f} s")


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    intro = (
        f"Each ratio: the policy's goodput averaged over {args.seeds} seeds of restart jitter "
        "divided by experiment 5's seed-averaged hindsight best fixed interval "
        f"(`{Path(args.exp5).name}`; the same jobs, jitter and seeds). `PA`: as shipped "
        "(`PreemptionAware(GammaPoissonRate.from_traces(history))`, history every trace of "
        "another zone); `PA in experiment 5` is that experiment's column, which `PA` "
        "reproduces. `costs known`: the job's stall, time to durable, restart and step time "
        "as its priors. `whole history`: one policy object through the whole job "
        "(`policy_state=process`), never rolled back to a checkpoint's copy; it also sees "
        "the kills that come while a process restarts, which no engine process sees. `both`: "
        "the two."
    )
    text = header("What PA's inputs are worth: PA given what it has to learn", intro)
    for regime in args.regimes:
        part = [r for r in rows if r["regime"] == regime]
        summary = [
            {
                "policy / hindsight": variant,
                "mean": statistics.fmean(r[variant] for r in part),
                "min": min(r[variant] for r in part),
                "min on": min(part, key=lambda r, v=variant: r[v])["trace"],
                f"traces >= {GOOD}": f"{sum(r[variant] >= GOOD for r in part)} / {len(part)}",
            }
            for variant in (*VARIANTS, "PA in experiment 5")
        ]
        text += f"## {regime} checkpoints\n\n" + markdown_table(summary, list(summary[0]), digits=4)
        text += "\n" + markdown_table(part, ["trace", *VARIANTS, "PA in experiment 5"], digits=4)
        text += "\n"
    return text


if __name__ == "__main__":
    main()
