"""Experiment 4: sensitivity grid of checkpoint cost x MTBF: where each interval policy wins.

Synthetic availability traces (``poisson_trace``: exponential up-times of mean MTBF,
exponential outages of mean 10 min, 14 days, 3 seeds per cell). The job: 1 s steps,
5 min restart, stall C (the grid's cost axis), time to durable C + 60 s, 2 in flight.
Policies: fixed 30 min and 2 h, Young and Daly with the true MTBF, CheckFreq, overhead
budget 5 %, preemption-aware with a generic 1 h prior (it must learn the rate), all
relative to the oracle.

    python experiments/sim/exp4_sensitivity.py
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from common import RESULTS, csv_header, header, write_results

import pcframe.policies as P
from pcframe.sim import JobSpec, Oracle, poisson_trace
from pcframe.sim.report import markdown_table, write_csv
from pcframe.sim.sweep import Case, run_cases

COSTS = (1.0, 4.0, 16.0, 64.0, 256.0)
MTBFS_H = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 24.0)
SEEDS = (0, 1, 2)


def policies(mtbf: float) -> dict[str, Any]:
    return {
        "fixed 30 min": lambda t: P.FixedSteps(1800),
        "fixed 2 h": lambda t: P.FixedSteps(7200),
        "Young": lambda t: P.Young(mtbf=mtbf),
        "Daly": lambda t: P.Daly(mtbf=mtbf),
        "CheckFreq": lambda t: P.CheckFreq(),
        "overhead 5%": lambda t: P.OverheadBudget(0.05),
        "preemption-aware": lambda t: P.PreemptionAware(
            P.GammaPoissonRate(3600.0), min_interval=30.0, max_interval=21600.0
        ),
        "oracle": lambda t: Oracle(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--days", type=float, default=14.0)
    parser.add_argument("--out", default=str(RESULTS / "sim_exp4_sensitivity"))
    args = parser.parse_args()
    cases = []
    for mtbf_h in MTBFS_H:
        for seed in SEEDS:
            trace = poisson_trace(mtbf_h * 3600.0, args.days * 24.0, outage=600.0, seed=seed)
            for cost in COSTS:
                job = JobSpec(
                    iteration_time=1.0,
                    save_stall=cost,
                    save_duration=cost + 60.0,
                    max_in_flight=2,
                    restart_cost=300.0,
                )
                for label, make in policies(mtbf_h * 3600.0).items():
                    params = {"mtbf_h": mtbf_h, "cost_s": cost, "seed": seed}
                    cases.append(Case(trace, label, make, job, params=params))
    results = run_cases(cases, description="exp4 sensitivity")
    rows = [r.row() for r in results]
    out = Path(args.out)
    write_csv(rows, out.with_suffix(".csv"), header=csv_header())
    labels = [k for k in policies(1.0) if k != "oracle"]
    cells = _cells(rows, labels)
    text = header(
        "Experiment 4: checkpoint cost x MTBF sensitivity",
        f"Synthetic traces, {args.days:g} days, 10 min mean outage, seeds {list(SEEDS)}. "
        "Values: goodput / oracle goodput, mean over seeds. Winner = highest mean; `~` marks "
        "cells where the runner-up is within 0.5 %.",
    )
    text += "## Winner per cell (rows: stall C in s; columns: MTBF)\n\n"
    text += _grid(cells, lambda c: c["winner"])
    codes = dict(zip(labels, ("F30", "F2h", "Y", "D", "CF", "OB", "PA"), strict=True))
    text += (
        "\n## Every policy within 1 % of the cell's best\n\n"
        + ", ".join(f"{v} = {k}" for k, v in codes.items())
        + "\n\n"
    )
    text += _grid(
        cells,
        lambda c: " ".join(codes[k] for k in labels if c["ratios"][k] >= c["best"] - 0.01),
    )
    for label in labels:
        text += f"\n## {label}: goodput / oracle\n\n"
        text += _grid(cells, lambda c, lab=label: f"{c['ratios'][lab]:.3f}")
    text += "\n## Regret: how far each policy is from the best policy of the cell\n\n"
    regret = []
    for label in labels:
        gaps = [c["best"] - c["ratios"][label] for c in cells.values()]
        regret.append(
            {
                "policy": label,
                "cells won": sum(c["winner"].rstrip(" ~") == label for c in cells.values()),
                "mean gap": statistics.fmean(gaps),
                "worst gap": max(gaps),
            }
        )
    text += markdown_table(regret, list(regret[0]), digits=3)
    write_results(out.with_suffix(".md"), text)
    _heatmap(cells, labels, out.parent / f"{out.name}.png")
    print(f"wrote {out.with_suffix('.md')}")


def _cells(rows: list[dict[str, Any]], labels: list[str]) -> dict[tuple, dict[str, Any]]:
    cells = {}
    for mtbf_h in MTBFS_H:
        for cost in COSTS:
            part = [r for r in rows if r["p_mtbf_h"] == mtbf_h and r["p_cost_s"] == cost]
            ratios = {}
            for label in labels:
                vals = []
                for seed in SEEDS:
                    mine = next(r for r in part if r["label"] == label and r["p_seed"] == seed)
                    oracle = next(r for r in part if r["label"] == "oracle" and r["p_seed"] == seed)
                    vals.append(mine["goodput"] / oracle["goodput"])
                ratios[label] = statistics.fmean(vals)
            ranked = sorted(ratios, key=ratios.get, reverse=True)
            close = ratios[ranked[0]] - ratios[ranked[1]] < 0.005
            cells[(mtbf_h, cost)] = {
                "ratios": ratios,
                "best": ratios[ranked[0]],
                "winner": ranked[0] + (" ~" if close else ""),
            }
    return cells


def _grid(cells: dict[tuple, dict[str, Any]], show: Any) -> str:
    table = []
    for cost in COSTS:
        row: dict[str, Any] = {"C (s)": f"{cost:g}"}
        for mtbf_h in MTBFS_H:
            row[f"M={mtbf_h:g} h"] = show(cells[(mtbf_h, cost)])
        table.append(row)
    return markdown_table(table, list(table[0]))


def _heatmap(cells: dict[tuple, dict[str, Any]], labels: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    index = {label: i for i, label in enumerate(labels)}
    win = np.array([[index[cells[(m, c)]["winner"].rstrip(" ~")] for m in MTBFS_H] for c in COSTS])
    cmap = plt.get_cmap("tab10", len(labels))
    im = axes[0].imshow(win, cmap=cmap, vmin=-0.5, vmax=len(labels) - 0.5, aspect="auto")
    cbar = fig.colorbar(im, ax=axes[0], ticks=range(len(labels)))
    cbar.ax.set_yticklabels(labels, fontsize=7)
    axes[0].set_title("best policy (goodput)")
    pa = np.array([[cells[(m, c)]["ratios"]["preemption-aware"] for m in MTBFS_H] for c in COSTS])
    fixed = np.array([[cells[(m, c)]["ratios"]["fixed 30 min"] for m in MTBFS_H] for c in COSTS])
    im2 = axes[1].imshow(pa / fixed, cmap="RdBu", vmin=0.5, vmax=1.5, aspect="auto")
    fig.colorbar(im2, ax=axes[1])
    axes[1].set_title("preemption-aware / fixed 30 min (goodput)")
    for i in range(len(COSTS)):
        for j in range(len(MTBFS_H)):
            axes[1].text(
                j, i, f"{pa[i, j] / fixed[i, j]:.2f}", ha="center", va="center", fontsize=7
            )
    for ax in axes:
        ax.set_xticks(range(len(MTBFS_H)))
        ax.set_xticklabels([f"{m:g}" for m in MTBFS_H])
        ax.set_yticks(range(len(COSTS)))
        ax.set_yticklabels([f"{c:g}" for c in COSTS])
        ax.set_xlabel("MTBF (h)")
        ax.set_ylabel("checkpoint stall C (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
