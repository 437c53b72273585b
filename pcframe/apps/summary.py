"""``pcframe-run``'s results: the terminal summary, ``summary.json`` / ``summary.csv`` per job,
and one merged table for a ``--multirun`` sweep (:class:`AggregateRuns`, a Hydra callback).
"""

from __future__ import annotations

import csv
import json
import math
import shlex
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from pcframe.text import markdown_row, one_line

Summary = dict[str, Any]

JSON_NAME = "summary.json"
CSV_NAME = "summary.csv"

# Table rows, in order: summary key -> label. Keys absent from a summary are not shown.
LABELS = {
    "workload": "workload",
    "steps": "training steps",
    "policy": "checkpoint policy",
    "threads": "torch threads",
    "schedule": "kill schedule",
    "kills": "preemptions injected (SIGKILL)",
    "processes": "training processes started",
    "checkpoints": "checkpoints committed",
    "saves_failed": "saves failed",
    "stall_mean_ms": "stall per checkpoint, mean (ms)",
    "stall_max_ms": "stall per checkpoint, max (ms)",
    "durable_mean_ms": "save() to durable, mean (ms)",
    "bytes_written": "bytes written",
    "baseline_steps_per_s": "steps/s without checkpointing",
    "steps_per_s": "steps/s with checkpointing",
    "overhead": "throughput overhead",
    "baseline_spread_pct": "run-to-run spread of the baseline (%)",
    "start_step": "resumed from step",
    "final_loss": "final loss",
    "executed_steps": "steps executed (incl. lost)",
    "lost_steps": "steps lost to preemptions",
    "wall_s": "wall time (s)",
    "goodput_steps_per_s": "goodput (useful steps/s)",
    "restart_mean_s": "restart time, kill to next step, mean (s)",
    "restore_mean_s": "restore from checkpoint, mean (s)",
    "reference_wall_s": "wall time without preemptions (s)",
    "efficiency": "efficiency (reference / actual wall time)",
    "matches_reference": "final model equals uninterrupted run",
}

# Columns of the merged sweep table (the CSV has every key).
SWEEP_COLUMNS = {
    "steps_per_s": "steps/s",
    "overhead": "overhead",
    "checkpoints": "ckpts",
    "stall_mean_ms": "stall ms",
    "durable_mean_ms": "durable ms",
    "kills": "kills",
    "lost_steps": "lost steps",
    "goodput_steps_per_s": "goodput",
    "efficiency": "efficiency",
    "matches_reference": "bit-identical",
}


def text(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:,.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "" if value is None else str(value)


MIN_RUNS_FOR_SPREAD = 3  # fewer baseline runs give no ±: their spread is one draw of the noise


def baseline_spread(baselines: Sequence[float]) -> tuple[float, float | None]:
    """``(range, sd)`` of the baseline runs' steps/s, in % of their mean.

    ``range`` (max - min) is what the runs show; ``sd`` (the sample standard deviation: how
    much one run varies by itself) is an uncertainty only from ``MIN_RUNS_FOR_SPREAD`` runs
    on, and ``None`` below.
    """
    mean = statistics.fmean(baselines)
    if not mean:
        return 0.0, None
    spread = 100 * (max(baselines) - min(baselines)) / mean
    if len(baselines) < MIN_RUNS_FOR_SPREAD:
        return spread, None
    return spread, 100 * statistics.stdev(baselines) / mean


def overhead_text(overhead_pct: float, baselines: Sequence[float]) -> str:
    """The overhead against ``baselines`` (the steps/s of each run without checkpoints).

    From 3 runs on, with its uncertainty: ``"+12.3 % ± 4.0 % (sd of 5 baseline runs)"``,
    ``(within noise)`` when that covers it. With fewer, no ±: two runs' difference is one
    draw of the noise, not its size, and a ± from it reads as a result it is not
    (``"+12.3 % (2 baseline runs: too few for an error bar)"``).
    """
    _, sd = baseline_spread(baselines)
    runs = len(baselines)
    if sd is None:  # their spread is a row of its own (baseline_spread_pct)
        plural = "s" if runs != 1 else ""
        return f"{overhead_pct:+.1f} % ({runs} baseline run{plural}: too few for an error bar)"
    shown = f"{overhead_pct:+.1f} % ± {sd:.1f} % (sd of {runs} baseline runs)"
    return shown + " (within noise)" if abs(overhead_pct) <= sd else shown


def print_summary(
    summary: Summary, title: str = "pcframe-run summary", console: Console | None = None
) -> None:
    """The table, then any warnings, then the checkpoint folder and the next command."""
    console = console or Console()
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right", overflow="fold")
    for key, label in LABELS.items():
        if key in summary and summary[key] is not None:
            table.add_row(label, text(summary[key]))
    console.print(table)
    for warning in summary.get("warnings", []):
        console.print(
            Panel(warning, title="WARNING", title_align="left", border_style="bold red"),
            style="bold",
        )
    directory = summary.get("directory")
    if directory:
        # Plain lines, never cut: the folder and what to run next.
        print(f"checkpoints: {directory}")
        print(f"next: pcframe list {shlex.quote(str(directory))}")


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_summary(
    summary: Summary, out_dir: str | Path, overrides: Sequence[str] = (), job: int | None = None
) -> list[Path]:
    """``summary.json`` (summary, warnings, overrides) and ``summary.csv`` (one row)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    scalars = {k: _plain(v) for k, v in summary.items() if k != "warnings"}
    document = {
        "app": "pcframe-run",
        "job": job,
        "overrides": list(overrides),
        "summary": scalars,
        "warnings": list(summary.get("warnings", [])),
    }
    json_path = out / JSON_NAME
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    csv_path = out / CSV_NAME
    row = {"job": job, **_override_columns(overrides), **scalars}
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return [json_path, csv_path]


def _override_columns(overrides: Sequence[str]) -> dict[str, str]:
    """``{"engine.max_in_flight": "3"}`` from ``["engine.max_in_flight=3"]`` (no hydra.*)."""
    columns = {}
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.lstrip("+~")
        if sep and not key.startswith("hydra."):
            columns[key] = value
    return columns


def read_job_summaries(sweep: str | Path) -> list[dict[str, Any]]:
    """Rows of every ``summary.json`` under a sweep folder, in job order."""
    rows = []
    for path in Path(sweep).rglob(JSON_NAME):
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        overrides = document.get("overrides", [])
        row = {"job": document.get("job"), "overrides": " ".join(overrides)}
        row.update(_override_columns(overrides))
        row.update(document.get("summary", {}))
        row["warnings"] = " | ".join(document.get("warnings", []))
        row["folder"] = str(path.parent)
        rows.append(row)
    rows.sort(key=lambda r: (r["job"] is None, r["job"] if r["job"] is not None else 0))
    return rows


def merge_sweep(sweep: str | Path, console: Console | None = None) -> list[Path]:
    """Write ``sweep_summary.csv`` and ``sweep_summary.md`` and print the merged table."""
    rows = read_job_summaries(sweep)
    if not rows:
        return []
    sweep = Path(sweep)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    csv_path = sweep / "sweep_summary.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in columns})
    overrides = set().union(*(_override_columns(r["overrides"].split()) for r in rows))
    varying = [k for k in columns if k in overrides and len({str(r.get(k)) for r in rows}) > 1]
    shown = ["job", *varying] + [k for k in SWEEP_COLUMNS if any(k in r for r in rows)]
    headers = [SWEEP_COLUMNS.get(k, k) for k in shown]
    cells = [[text(row.get(k)) for k in shown] for row in rows]
    md_path = sweep / "sweep_summary.md"
    lines = [
        f"# pcframe-run sweep: {len(rows)} jobs in {one_line(sweep)}",
        "",
        markdown_row(headers),
        "|" + "---|" * len(headers),
        *(markdown_row(c) for c in cells),
        "",
    ]
    warned = [r for r in rows if r.get("warnings")]
    for row in warned:
        lines.append(f"- job {row['job']}: {one_line(row['warnings'])}")
    md_path.write_text("\n".join(lines) + "\n")
    console = console or Console()
    table = Table(title=f"pcframe-run sweep: {len(rows)} jobs")
    for header, key in zip(headers, shown, strict=True):
        table.add_column(header, justify="left" if key in varying else "right")
    for row_cells in cells:
        table.add_row(*row_cells)
    console.print(table)
    for row in warned:
        console.print(f"[bold red]job {row['job']}:[/bold red] {row['warnings']}")
    print(f"wrote {csv_path}")
    print(f"wrote {md_path}")
    return [csv_path, md_path]


class AggregateRuns(Callback):
    """After a ``--multirun``: one merged table of every job's summary (CSV, Markdown, terminal)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        merge_sweep(config.hydra.sweep.dir)
