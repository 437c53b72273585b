"""The EuroMLSys '26 claims restated on real traces, from experiments 2, 3 and 5's CSVs.

1. "+60.27 % training throughput from dynamic interval tuning vs fixed intervals": the
   gain of the preemption-aware policy (PA) over fixed intervals of 5 min / 30 min / 2 h
   (experiment 2), over the fixed interval a user would choose in advance from other zones
   and over the best one in hindsight (experiment 5), per regime, with the condition under
   which +60 % appears: the fixed interval against the trace's MTBF.
2. "2.04x throughput at 51.41 % lower cost from spot + on-demand": the hybrid of experiment 3
   against on-demand only, per trace, with the conditions: the spot price against the
   on-demand price and the spot availability of the trace.

Run experiments 2, 3 and 5 first; this reads their CSVs:

    python experiments/sim/claims.py
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from pathlib import Path

from common import RESULTS, csv_header, header, write_results

from pcframe.sim.report import markdown_table, write_csv

FIXED_SECONDS = {"fixed 5 min": 300.0, "fixed 30 min": 1800.0, "fixed 2 h": 7200.0}
CLAIM_GAIN = 0.6027
CLAIM_X, CLAIM_COST = 2.04, -0.5141


def read(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def interval_claim(exp2: list[dict[str, str]], exp5: list[dict[str, str]]) -> list[dict]:
    by = {(r["p_regime"], r["trace"], r["label"]): r for r in exp2}
    rows = []
    for regime in dict.fromkeys(r["p_regime"] for r in exp2):
        traces = list(dict.fromkeys(r["trace"] for r in exp2 if r["p_regime"] == regime))
        for base in (*FIXED_SECONDS, "best fixed (hindsight)"):
            gains, conditions = [], []
            for t in traces:
                pa = float(by[(regime, t, "preemption-aware")]["goodput"])
                fixed = float(by[(regime, t, base)]["goodput"])
                gains.append(pa / fixed - 1.0 if fixed > 0 else math.inf)
                mtbf_s = 3600.0 * float(by[(regime, t, base)]["p_mtbf_h"])
                conditions.append(FIXED_SECONDS.get(base, math.nan) / mtbf_s)
            rows.append(_gain_row(regime, base, gains, conditions))
        part = [r for r in exp5 if r["regime"] == regime]
        for base, key in (
            ("chosen in advance (LOO)", "in_advance"),
            ("hindsight (LOO)", "hindsight"),
        ):
            gains = [
                float(r["PA"]) / float(r[key]) - 1.0 if float(r[key]) > 0 else math.inf
                for r in part
            ]
            rows.append(_gain_row(regime, base, gains, [math.nan] * len(gains)))
    return rows


def _gain_row(regime: str, base: str, gains: list[float], ratio: list[float]) -> dict:
    hits = [x for g, x in zip(gains, ratio, strict=True) if g >= CLAIM_GAIN]
    finite = [g for g in gains if math.isfinite(g)]
    return {
        "regime": regime,
        "PA vs fixed interval": base,
        "median gain %": 100.0 * statistics.median(gains) if finite else math.nan,
        "max gain %": 100.0 * max(gains),
        "traces >= +60 %": f"{sum(g >= CLAIM_GAIN for g in gains)} / {len(gains)}",
        "traces worse than -0.5 %": sum(g < -0.005 for g in gains),
        "where +60 % holds: fixed interval / MTBF (min)": min(hits) if hits else math.nan,
    }


def resource_claim(exp3: list[dict[str, str]]) -> list[dict]:
    by = {(r["trace"], r["label"]): r for r in exp3 if r["p_part"] == "open"}
    rows = []
    for trace in dict.fromkeys(t for t, _ in by):
        od, hy = by.get((trace, "on-demand only")), by.get((trace, "hybrid (<=4 spot)"))
        spot = by.get((trace, "spot only"))
        if od is None or hy is None or spot is None:
            continue
        x = float(hy["goodput"]) / float(od["goodput"])
        per_step = float(hy["dollars_per_kstep"]) / float(od["dollars_per_kstep"]) - 1.0
        spot_per_step = float(spot["dollars_per_kstep"]) / float(od["dollars_per_kstep"])
        rows.append(
            {
                "trace": trace,
                "source": hy["source"],
                "hybrid throughput x on-demand": x,
                "hybrid cost/step vs on-demand %": 100.0 * per_step,
                "claim holds": x >= CLAIM_X and per_step <= CLAIM_COST,
                "spot-only cost/step vs on-demand": spot_per_step,
                "spot availability": float(spot["spot_vm_hours"]) / float(spot["wall_hours"]),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "sim_claims"))
    args = parser.parse_args()
    exp2 = read(RESULTS / "sim_exp2_interval_policies.csv")
    exp3 = read(RESULTS / "sim_exp3_resources.csv")
    exp5 = read(RESULTS / "sim_exp5_loo_hindsight.csv")
    intervals = interval_claim(exp2, exp5)
    resources = resource_claim(exp3)
    out = Path(args.out)
    write_csv(
        [{"claim": "interval", **r} for r in intervals]
        + [{"claim": "hybrid", **r} for r in resources],
        out.with_suffix(".csv"),
        header=csv_header(),
    )
    text = header(
        "The EuroMLSys '26 claims on real traces",
        "From `sim_exp2_interval_policies.csv`, `sim_exp5_loo_hindsight.csv` and "
        "`sim_exp3_resources.csv` (rerun those first). PA: the shipped preemption-aware "
        "policy with its defaults and a prior from the other zones' traces.",
    )
    text += _interval_text(intervals) + _resource_text(resources)
    write_results(out.with_suffix(".md"), text)
    _plot(exp2, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')}")


def _interval_text(rows: list[dict]) -> str:
    return (
        "## 1. +60.27 % throughput from dynamic intervals\n\n"
        "Gain = goodput(PA) / goodput(fixed) - 1 per trace (20 traces per regime). The last "
        "column: the smallest ratio of the fixed interval to the trace's MTBF among the "
        "traces where the gain reaches +60 %.\n\n"
        + markdown_table(rows, list(rows[0]), digits=2)
        + "\n**Holds when** the fixed interval it is compared with is about as long as the "
        "zone's MTBF or longer (checkpoints rarely complete before a preemption), or, with "
        "blocking saves, when a short fixed interval pays its stall far too often. Against a "
        "fixed interval chosen sensibly (in advance from other zones, or in hindsight) the "
        "gain of dynamic intervals is a few percent at most, and PA's learning is what earns "
        "it (experiment 5).\n\n"
    )


def _resource_text(rows: list[dict]) -> str:
    holds = [r for r in rows if r["claim holds"]]
    summary = []
    for source in dict.fromkeys(r["source"] for r in rows):
        part = [r for r in rows if r["source"] == source]
        summary.append(
            {
                "traces": source,
                "claim holds": f"{sum(r['claim holds'] for r in part)} / {len(part)}",
                "median throughput x": statistics.median(
                    r["hybrid throughput x on-demand"] for r in part
                ),
                "median cost/step %": statistics.median(
                    r["hybrid cost/step vs on-demand %"] for r in part
                ),
                "median spot cost/step vs on-demand": statistics.median(
                    r["spot-only cost/step vs on-demand"] for r in part
                ),
            }
        )
    cond = ""
    if holds:
        price = max(r["spot-only cost/step vs on-demand"] for r in holds)
        up = min(r["spot availability"] for r in holds)
        cond = (
            f" Where it holds, spot-only costs {price:.2f}x on-demand per step or less and "
            f"spot is available {up:.0%} of the time or more."
        )
    return (
        "## 2. 2.04x throughput at 51.41 % lower cost from spot + on-demand\n\n"
        "The hybrid (predicted availability < 0.3: one on-demand VM; > 0.7: spot scaled out "
        "to 4 VMs) against on-demand only, whole trace, Daly intervals.\n\n"
        + markdown_table(summary, list(summary[0]), digits=2)
        + "\nPer trace:\n\n"
        + markdown_table(rows, list(rows[0]), digits=2)
        + "\n**Holds when** the hybrid can scale out on spot VMs that are cheap (about a "
        "quarter of the on-demand price per step) and mostly available, and the comparison "
        f"is with one on-demand VM: 2x is the scale-out, not a better use of one VM.{cond} "
        "Against spot only, the hybrid buys throughput at a higher cost per step.\n"
    )


def _plot(exp2: list[dict[str, str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["p_regime"], r["trace"], r["label"]): r for r in exp2}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for regime, marker in (("async", "o"), ("sync", "s")):
        for base, seconds in FIXED_SECONDS.items():
            xs, ys = [], []
            for (reg, trace, label), r in by.items():
                if reg != regime or label != base:
                    continue
                fixed = float(r["goodput"])
                pa = float(by[(reg, trace, "preemption-aware")]["goodput"])
                if fixed > 0:
                    xs.append(seconds / (3600.0 * float(r["p_mtbf_h"])))
                    ys.append(100.0 * (pa / fixed - 1.0))
            ax.scatter(xs, ys, marker=marker, s=18, label=f"{regime}, vs {base}")
    ax.axhline(100 * CLAIM_GAIN, color="red", ls="--", lw=0.8, label="+60.27 % (claim)")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlabel("fixed interval / trace MTBF")
    ax.set_ylabel("PA gain over the fixed interval (%)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
