"""How fast is the simulator? CPU seconds per simulation of a whole trace, per policy.

Every 45-day SkyNomad V100 trace (and, for scale, the 14-day H100 zones) under every
shipped interval policy, the V100 job of ``conf/sim/job/v100_llm.yaml`` (1 s steps).
CPU time of this process (``time.process_time``), so other jobs on a shared machine do not
inflate it; the Numba kernel is compiled (or loaded from its cache) before timing.

    python experiments/sim/speed.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import RESULTS, csv_header, header, write_results
from profiles import job_for

import pcframe.policies as P
from pcframe.policies.traces import load_traces, shared_traces_dir
from pcframe.sim import Oracle, SimOptions, simulate
from pcframe.sim.report import markdown_table, write_csv


def policies(mtbf: float) -> dict:
    return {
        "fixed every 10 steps": lambda: P.FixedSteps(10),
        "fixed every 1000 steps": lambda: P.FixedSteps(1000),
        "fixed time 10 min": lambda: P.FixedTime(600.0),
        "Young": lambda: P.Young(mtbf=mtbf),
        "Daly": lambda: P.Daly(mtbf=mtbf),
        "CheckFreq": P.CheckFreq,
        "overhead 5%": lambda: P.OverheadBudget(0.05),
        "preemption-aware": lambda: P.PreemptionAware(P.GammaPoissonRate(3600.0)),
        "notice + Daly": lambda: P.NoticeDriven(P.Daly(mtbf=mtbf)),
        "oracle": Oracle,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "sim_speed"))
    args = parser.parse_args()
    traces = [t for t in load_traces(shared_traces_dir()) if t.capacity == 1]
    warm = traces[0]
    simulate(warm, P.FixedSteps(10), job_for(warm), options=SimOptions(duration=3600.0))
    rows = []
    for trace in traces:
        job = job_for(trace)
        for label, make in policies(trace.mtbf()).items():
            begin = time.process_time()
            r = simulate(trace, make(), job)
            rows.append(
                {
                    "trace": trace.name,
                    "days": trace.duration / 86400.0,
                    "policy": label,
                    "cpu_s": time.process_time() - begin,
                    "saves": r.saves,
                    "decisions": r.decisions,
                    "preemptions": r.preemptions,
                }
            )
            print(f"{trace.name:28s} {label:22s} {rows[-1]['cpu_s']:.3f} s  {r.saves} saves")
    out = Path(args.out)
    write_csv(rows, out.with_suffix(".csv"), header=csv_header())
    summary = []
    for label in policies(1.0):
        for family, pick in (("V100, 45 days", "v100"), ("H100, 14.7 days", "h100")):
            part = [r for r in rows if r["policy"] == label and pick in r["trace"]]
            summary.append(
                {
                    "policy": label,
                    "traces": family,
                    "median cpu s": statistics.median(r["cpu_s"] for r in part),
                    "max cpu s": max(r["cpu_s"] for r in part),
                    "median saves": statistics.median(r["saves"] for r in part),
                    "median decide calls": statistics.median(r["decisions"] for r in part),
                }
            )
    text = header(
        "Simulator speed: one whole trace x one policy",
        "CPU seconds of one `simulate()` call (Numba kernel already compiled). Saves: "
        "checkpoints simulated; decide calls: how often the policy's `decide` ran (the rest "
        "were skipped by hints, the periodic kernel or the steady-state fast-forward).",
    )
    text += markdown_table(summary, list(summary[0]), digits=3)
    total = sum(r["cpu_s"] for r in rows)
    text += f"\nAll {len(rows)} simulations: {total:.1f} CPU s.\n"
    write_results(out.with_suffix(".md"), text)
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
