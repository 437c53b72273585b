"""PreemptionAware on the simulator's hinted path (the default) against asked at every step.

Experiment 5's setup (the shipped job presets, the leave-one-zone-out prior): for every
shipped trace, PA's goodput both ways and their ratio. Until 2026-12-05 the ratio ranged
0.962-1.011 (sync): PA's hint did not name its re-predictions (every 30 s when asked at
every step), so the hinted path adopted other intervals. Now 1.0000 on every trace;
``path_agreement.py`` checks every shipped policy the same way (docs/simulator.md).

    python experiments/sim/pa_hint_paths.py --regime sync
"""

from __future__ import annotations

import argparse
import statistics

from loo import history_for
from profiles import job_for

import pcframe.policies as P
from pcframe.policies.traces import load_traces, shared_traces_dir
from pcframe.sim import SimOptions, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", choices=("async", "sync"), default="sync")
    args = parser.parse_args()
    traces = load_traces(shared_traces_dir())
    ratios = []
    for trace in traces:
        job = job_for(trace, args.regime)
        history = history_for(trace, traces)
        runs = [
            simulate(
                trace,
                P.PreemptionAware(P.GammaPoissonRate.from_traces(history)),
                job,
                options=SimOptions(use_hints=hints),
            ).goodput
            for hints in (True, False)
        ]
        ratios.append(runs[1] / runs[0])
        print(f"{trace.name:28s} hinted {runs[0]:.4f}  every step {runs[1]:.4f}  {ratios[-1]:.4f}")
    print(
        f"{args.regime}: every step / hinted, mean {statistics.mean(ratios):.4f}, "
        f"min {min(ratios):.4f}, max {max(ratios):.4f}"
    )


if __name__ == "__main__":
    main()
