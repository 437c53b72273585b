"""How finely one replay can check the simulator: each replay's own noise, known before it ran.

A replay is one draw of the machine's restart and step times against a fixed schedule of
kills. Where a kill lands just before or just after a commit, a fraction of a second of
restart time decides whether an interval's work is kept, so two replays of the same
configuration differ even when the event model is exact (``validate_replay.py``'s exact
check: 0.4 % over the committed campaign). The simulator's prediction of a replay is the
mean over seeds of restart and step times drawn with the calibrated spread; the spread of
those seeds is the replay's own noise, and it is known **before** the replay runs.

This script re-predicts every replay of a committed campaign (``<out>.raw.json`` and its
table ``<out>.csv``) from the calibration it was predicted from, checks that the mean of
the seeds is the table's prediction (the model has not moved since), and reports per
configuration the beforehand error over the window beside the noise of the configuration's
mean, as ``validate_replay.py`` now reports it for every campaign it runs
(``noise_window_pct``, ``noise_lines``): which configurations the replays cannot check to
5 %, how many shifted replays would, and which errors lie beyond the noise.

    python experiments/sim/replay_noise.py        # the committed campaign, ~1 min
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path
from typing import Any

from common import RESULTS, csv_header, header, write_results
from replay_setup import Config, seeded_priors, trace_setup
from replay_sizing import SIGMAS, TOLERANCE, replays_needed
from validate_replay import inputs, mean_row, noise_lines, predict

from pcframe.sim.report import markdown_table, write_csv


def table_rows(path: Path) -> list[dict[str, Any]]:
    """The campaign's table (its CSV, comment lines skipped), numbers as numbers."""

    def value(text: str) -> Any:
        try:
            return float(text)
        except ValueError:
            return text

    with path.open() as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return [{k: value(v) for k, v in r.items()} for r in rows]


def replay_noise(raw: dict[str, Any], cal: dict[str, Any], row: dict[str, Any], draws: int):
    """(mean prediction, relative noise %) of one replay over its window, from the inputs
    it was predicted from before it ran."""
    _, setup = trace_setup(raw["trace"])
    config = Config.parse(raw["config"])
    x = inputs(cal, config.in_flight)
    kills = [k / 1e3 for k in raw["kills_ms"]]
    window = row["window_s"]
    sims = predict(
        x, config, kills, int(row["steps"]), draws, setup.gap, 1.0, seeded_priors(x), window
    )
    goodputs = [d.useful_steps / window for d in sims]
    mean = statistics.fmean(goodputs)
    return mean, 100.0 * statistics.stdev(goodputs) / mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--campaign", default=str(RESULTS / "sim_validation"))
    parser.add_argument("--draws", type=int, default=24, help="the campaign's --draws")
    parser.add_argument("--out", default=str(RESULTS / "sim_validation_noise"))
    args = parser.parse_args()
    campaign = Path(args.campaign)
    data = json.loads(campaign.with_suffix(".raw.json").read_text())
    for cal in data["calibrations"].values():  # JSON keys are strings: by in-flight count
        cal["costs"] = {int(n): c for n, c in cal["costs"].items()}
    replays = [r for r in table_rows(campaign.with_suffix(".csv")) if r["offset_gaps"] != "mean"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    drift = 0.0
    for raw in data["replays"]:
        row = next(
            r
            for r in replays
            if (r["trace"], r["config"], r["offset_gaps"])
            == (raw["trace"], raw["config"], raw["offset_gaps"])
        )
        cals = data["calibrations"]
        cal = cals.get(raw["trace"], cals.get(""))
        predicted, row["noise_window_pct"] = replay_noise(raw, cal, row, args.draws)
        drift = max(drift, abs(predicted / row["goodput_window_predicted"] - 1.0))
        groups.setdefault((raw["trace"], raw["config"]), []).append(row)
    per_config = [g[0] if len(g) == 1 else mean_row(g) for g in groups.values()]
    for r, g in zip(per_config, groups.values(), strict=True):
        r["replays"] = len(g)
        r["z"] = r["error_window_pct"] / r["noise_window_pct"] if r["noise_window_pct"] else 0.0
        r["replays_for_5pct"] = replays_needed(r["noise_window_pct"], len(g))
    out = Path(args.out)
    cols = ["trace", "config", "replays", "error_window_pct", "noise_window_pct", "z"]
    cols += ["replays_for_5pct", "error_window_in_replay_pct", "error_window_exact_pct"]
    write_csv([{k: r[k] for k in cols} for r in per_config], out.with_suffix(".csv"), csv_header())
    intro = (
        f"Campaign: `{campaign.with_suffix('.csv').relative_to(RESULTS.parents[1])}` and its "
        f"raw replays, each re-predicted from the calibration it was predicted from ({args.draws} "
        "seeds over its window). `noise_window_pct`: the spread of those seeds' goodput "
        "relative to their mean, known before the replay ran (for a configuration of several "
        "shifted replays, the noise of their mean: independent draws add in quadrature); `z`: "
        "the beforehand error in units of it; `replays_for_5pct`: shifted replays needed for "
        f"{SIGMAS:g} x the noise to fit in {TOLERANCE:g} %.\n\n"
        + "\n".join(noise_lines(per_config, [len(g) for g in groups.values()]))
        + f"\n- the seeds' mean matches the campaign's prediction to {100 * drift:.2g} % "
        "(the model has not moved since the campaign)"
    )
    text = header("How finely a replay checks the simulator: each replay's own noise", intro)
    write_results(out.with_suffix(".md"), text + markdown_table(per_config, cols) + "\n")
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
