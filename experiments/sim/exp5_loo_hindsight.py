"""Experiment 5: the preemption-aware policy against fixed intervals chosen in hindsight,
leave-one-zone-out, and the notice path against the oracle.

1. For every shipped trace, both checkpoint regimes (``async``, ``sync``) of the shipped job
   presets: ``PreemptionAware`` as a user gets it (its defaults, the predictor
   ``GammaPoissonRate.from_traces(history)``) where the history is every trace of *another*
   zone; beside it Daly at the history's MTBF, the fixed interval chosen in advance (best
   mean over the other zones' traces), the best fixed interval in hindsight and the oracle.
2. Notices: ``NoticeDriven(PreemptionAware)`` on the H100 zones (GCP, 30 s notice) with a
   tier that survives the VM and makes the newest state durable in 10-30 s, and on the
   V100 traces with AWS's 120 s notice (the checkpoint tier itself, 90 s, fits): the gap to
   the oracle before (the notice ignored) and after.

    python experiments/sim/exp5_loo_hindsight.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

from common import FAMILIES, RESULTS, csv_header, header, write_results
from loo import SECONDS_GRID, evaluate, fixed_curves, history_for
from profiles import job_for

import pcframe.policies as P
from pcframe.policies.traces import Trace, load_traces, shared_traces_dir
from pcframe.sim import Oracle, simulate
from pcframe.sim.report import markdown_table, write_csv

SURVIVOR_SECONDS = (10.0, 20.0, 25.0, 30.0)


def pa(trace: Trace, history: list[Trace]) -> P.IntervalPolicy:
    """The shipped policy with its defaults; only the history is the user's."""
    return P.PreemptionAware(P.GammaPoissonRate.from_traces(history))


def pa_no_age(trace: Trace, history: list[Trace]) -> P.IntervalPolicy:
    """Ablation: the same learning, but Daly at the mean rate whatever the VM's age."""
    return P.PreemptionAware(P.GammaPoissonRate.from_traces(history), age_hazard=False)


def pa_kept_work(trace: Trace, history: list[Trace]) -> P.IntervalPolicy:
    """Variant: the schedule that keeps the most work over a whole life (``kept_work``)."""
    return P.PreemptionAware(P.GammaPoissonRate.from_traces(history), schedule="kept_work")


def pa_one_gamma(trace: Trace, history: list[Trace]) -> P.IntervalPolicy:
    """Ablation: the previous rate prior, one Gamma fitted to the zones' spread (no mixture)."""
    pred = P.GammaPoissonRate.from_traces(history, prior_components=None)
    return P.PreemptionAware(pred)


def pa_own_zone(trace: Trace, history: list[Trace]) -> P.IntervalPolicy:
    """Yardstick: the shipped policy whose history also holds the evaluated trace itself
    (a user who already has this zone's trace: its rate and life shape are in the prior)."""
    return P.PreemptionAware(P.GammaPoissonRate.from_traces([*history, trace]))


def pa_fixed_prior(trace: Trace, history: list[Trace]) -> P.IntervalPolicy:
    """Ablation: the old prior (6 h of history whatever the zones' spread), no life shape."""
    pred = P.GammaPoissonRate.from_traces(history, prior_strength=21600.0, life_prior=None)
    return P.PreemptionAware(pred)


# Measured with this experiment's harness on the code before this policy (commit 28580c7:
# a 6 h prior, Daly at the mean rate, restarts that died before committing not counted).
BEFORE = {"async": (0.9882, 0.8435, 15, 2), "sync": (0.9300, 0.5714, 1, 0)}
# The same harness on the policy before the mixture prior (commit 80679d9: one Gamma
# prior, the best single cycle at each age).
PREVIOUS = {"async": (0.9949, 0.9319, 16, 7), "sync": (0.9714, 0.7140, 10, 6)}
ABLATIONS = ("PA", "PA kept-work", "PA one Gamma", "PA no age", "PA 6 h prior", "PA own zone")
# What a policy told the answer's statistics in advance gets (not a policy a user can run).
CLAIRVOYANT = ("Daly@true",)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--regimes", nargs="+", default=["async", "sync"])
    parser.add_argument("--cache", default=None, help="JSON cache of the fixed-interval runs")
    parser.add_argument("--out", default=str(RESULTS / "sim_exp5_loo_hindsight"))
    args = parser.parse_args()
    traces = load_traces(shared_traces_dir())
    curves = fixed_curves(traces, args.regimes, args.cache)
    rows = evaluate(
        traces,
        args.regimes,
        curves,
        {
            "PA": pa,
            "PA kept-work": pa_kept_work,
            "PA one Gamma": pa_one_gamma,
            "PA no age": pa_no_age,
            "PA 6 h prior": pa_fixed_prior,
            "PA own zone": pa_own_zone,
        },
    )
    notice = notice_rows(traces, args.regimes)
    out = Path(args.out)
    write_csv(rows, out.with_suffix(".csv"), header=csv_header())
    write_csv(notice, out.parent / f"{out.name}_notice.csv", header=csv_header())
    text = header(
        "Experiment 5: preemption-aware vs the best fixed interval in hindsight (leave one "
        "zone out)",
        "Goodput of each policy divided by the goodput of the best `FixedSteps` interval "
        "found in hindsight on that trace (the simulator's `best_fixed_interval`). `PA`: "
        "`PreemptionAware(GammaPoissonRate.from_traces(history))`, every other argument at "
        "its default, where `history` is every shipped trace of another zone (traces without "
        "a zone are their own). `Daly@prior`: Daly at the history's pooled MTBF. `in advance`: "
        f"the fixed interval (of {len(SECONDS_GRID)} from 20 s to 12 h of training) with the "
        "best mean over the other zones' traces, relative to their own hindsight best. Job "
        "presets as in experiment 2 (`v100_llm`, `h100_llm`; `sync`: the stall is the whole "
        "write, one in flight). Spot only, notices not used (section 2 uses them). "
        "Variants: `PA kept-work` (`schedule='kept_work'`: the schedule that keeps the most work "
        "over a life instead of the best ratio of one cycle at each age), `PA one Gamma` (one "
        "Gamma prior fitted to the zones' spread instead of the mixture of one Gamma per trace: "
        "the previous policy), `PA no age` (`age_hazard=False`: Daly at the learned mean rate), "
        "`PA 6 h prior` (the old fixed prior weight, no life shape; restarts that died unseen are "
        "still counted). Yardsticks no user has: `PA own zone` (the history also holds the "
        "evaluated trace itself) and `Daly@true` (Daly at the evaluated trace's own MTBF, known in "
        "advance); what they leave to the hindsight best is where the preemptions happened to "
        "fall, which no interval chosen before them can know. `PA before`: this harness on "
        "the code before the learning policy (28580c7); `PA previous`: on the policy before "
        "the mixture prior (80679d9).",
    )
    for regime in args.regimes:
        part = [r for r in rows if r["regime"] == regime]
        text += f"## {regime} checkpoints\n\n" + _summary(part) + "\n" + _per_trace(part) + "\n"
    text += _notice_section(notice)
    write_results(out.with_suffix(".md"), text)
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')}")


def _relative(r: dict[str, Any]) -> dict[str, float]:
    h = r["hindsight"]
    return {
        **{label: r[label] / h for label in ABLATIONS},
        "Daly@prior": r["daly_prior"] / h,
        "Daly@true": r["daly_true"] / h,
        "in advance": r["in_advance"] / h,
        "oracle": r["oracle"] / h,
    }


def _summary(rows: list[dict[str, Any]]) -> str:
    table = []
    regime = rows[0]["regime"]
    for name, numbers in (("PA before (28580c7)", BEFORE), ("PA previous (80679d9)", PREVIOUS)):
        if regime not in numbers:
            continue
        mean, low, good, above = numbers[regime]
        table.append(
            {
                "policy / hindsight-best fixed": name,
                "mean": mean,
                "min": low,
                "traces >= 0.995": f"{good} / {len(rows)}",
                "traces >= 1.0": f"{above} / {len(rows)}",
            }
        )
    for label in (*ABLATIONS, "Daly@prior", *CLAIRVOYANT, "in advance", "oracle"):
        xs = [_relative(r)[label] for r in rows]
        table.append(
            {
                "policy / hindsight-best fixed": label,
                "mean": statistics.fmean(xs),
                "min": min(xs),
                "traces >= 0.995": f"{sum(x >= 0.995 for x in xs)} / {len(xs)}",
                "traces >= 1.0": f"{sum(x >= 1.0 for x in xs)} / {len(xs)}",
            }
        )
    cols = list(table[0])
    return markdown_table(table, cols, digits=4)


def _per_trace(rows: list[dict[str, Any]]) -> str:
    table = []
    for r in rows:
        rel = _relative(r)
        table.append(
            {
                "trace": r["trace"],
                "MTBF h": r["mtbf_h"],
                **{label: rel[label] for label in ABLATIONS},
                "Daly@prior": rel["Daly@prior"],
                "Daly@true": rel["Daly@true"],
                "in advance": rel["in advance"],
                "hindsight goodput": r["hindsight"],
                "hindsight interval s": r["hindsight_s"],
                "oracle": rel["oracle"],
                "PA sim s": r["PA_sim_s"],
            }
        )
    cols = list(table[0])
    return "Per trace (goodput / hindsight-best fixed; hindsight in steps/s):\n\n" + (
        markdown_table(table, cols, digits=4)
    )


def notice_rows(traces: list[Trace], regimes: list[str]) -> list[dict[str, Any]]:
    """Gap to the oracle with and without the notice path, per trace."""
    rows = []
    for regime in regimes:
        for trace in traces:
            history = history_for(trace, traces)
            base = job_for(trace, regime)
            if "h100" in trace.source:
                variants = [(base.notice_window, s) for s in SURVIVOR_SECONDS]
            else:  # AWS: 120 s of notice, and the checkpoint tier itself fits in it
                variants = [(120.0, None)]
            for window, survivor in variants:
                job = dataclasses.replace(
                    base, notice_window=window, survivor_tier_duration=survivor
                )
                oracle = simulate(trace, Oracle(), job).goodput
                before = simulate(trace, pa(trace, history), job).goodput
                policy = P.NoticeDriven(pa(trace, history))
                after = simulate(trace, policy, job)
                rows.append(
                    {
                        "regime": regime,
                        "family": FAMILIES.get(trace.source, trace.source),
                        "trace": trace.name,
                        "notice_s": window,
                        "survivor_tier_s": survivor if survivor is not None else job.save_duration,
                        "oracle": oracle,
                        "before": before / oracle,
                        "after": after.goodput / oracle,
                        "emergency_saves": after.emergency_saves,
                        "preemptions": after.preemptions,
                        "miss_fraction": policy.miss_fraction(),
                    }
                )
    return rows


def _notice_section(rows: list[dict[str, Any]]) -> str:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(
            (r["regime"], r["family"], r["notice_s"], r["survivor_tier_s"]), []
        ).append(r)
    table = []
    for (regime, family, window, survivor), part in groups.items():
        table.append(
            {
                "regime": regime,
                "family": family,
                "notice s": window,
                "surviving tier to durable s": survivor,
                "before: PA / oracle": statistics.fmean(r["before"] for r in part),
                "after: notice + PA / oracle": statistics.fmean(r["after"] for r in part),
                "preemptions secured": f"{sum(r['emergency_saves'] for r in part)} / "
                f"{sum(r['preemptions'] for r in part)}",
            }
        )
    cols = list(table[0])
    return (
        "## 2. Notices: the gap to the oracle\n\n"
        "`before`: PA alone (the notice is ignored); `after`: `NoticeDriven(PA)`: on a notice "
        "it saves the newest state to the fastest tier that survives the VM when that tier's "
        "time to durable plus the 5 s margin fits before the deadline (the simulator's "
        "`JobSpec.survivor_tier_duration`, seen as `ctx.tier_write_times['survivor']`), and it "
        "learns how often notices secure the work, so PA plans its periodic saves only for "
        "the preemptions they miss (`PreemptionAware.rate_scale`). The oracle saves once, as "
        "late as the fastest surviving tier allows. Mean over the traces of each family.\n\n"
        + markdown_table(table, cols, digits=4)
    )


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    fig, axes = plt.subplots(len(regimes), 1, figsize=(11, 3.6 * len(regimes)), squeeze=False)
    for ax, regime in zip(axes[:, 0], regimes, strict=True):
        part = [r for r in rows if r["regime"] == regime]
        xs = range(len(part))
        for offset, label in ((-0.25, "PA"), (0.0, "Daly@prior"), (0.25, "in advance")):
            ax.bar([x + offset for x in xs], [_relative(r)[label] for r in part], 0.25, label=label)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(0.995, color="grey", lw=0.8, ls="--")
        ax.set_ylim(0.8, 1.05)
        ax.set_xticks(list(xs), [r["trace"][:18] for r in part], rotation=70, fontsize=7)
        ax.set_ylabel("goodput / hindsight best")
        ax.set_title(f"{regime} checkpoints, leave one zone out")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
