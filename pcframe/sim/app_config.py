"""The Hydra side of ``pcframe-sim``: schemas, trace selection, cases, outputs, sweep merging.

Kept out of ``pcframe/apps/sim.py`` so that tests and experiment scripts can compose and run
the same configuration without going through the console script.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pcframe.errors import SimConfigError
from pcframe.policies.traces import Trace
from pcframe.sim.baselines import Oracle
from pcframe.sim.report import (
    markdown_table,
    plot_breakdown,
    plot_grouped_bars,
    read_csv,
    rows_of,
    write_csv,
)
from pcframe.sim.result import SimResult
from pcframe.sim.selection import select_traces
from pcframe.sim.spec import JobSpec, SimOptions
from pcframe.sim.sweep import BEST_FIXED, Case, run_cases
from pcframe.text import markdown_code

BASELINES = ("oracle", BEST_FIXED)
TABLE_COLUMNS = (
    "trace",
    "label",
    "goodput_ratio",
    "goodput",
    "useful_hours",
    "lost_hours",
    "stall_hours",
    "restart_hours",
    "waiting_hours",
    "preemptions",
    "saves",
    "cost",
    "dollars_per_kstep",
    "finished",
    "deadline_met",
)


def _schema_of(cls: type, name: str) -> type:
    """A structured-config dataclass with ``cls``'s fields; Literals become ``str`` (OmegaConf
    cannot type-check them; the real dataclass validates when it is built)."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if typing.get_origin(hint) is typing.Literal:
            hint = str
        if _optional_container(hint):
            # OmegaConf cannot merge a mapping into a typed None node, nor add keys to an
            # empty typed one under Hydra's struct flag: `sim.job.restart_by_tier={peers:
            # 420}` raised (nor type a tuple of pairs). Untyped, the value is set whole;
            # JobSpec validates it.
            hint = Any
        fields.append((f.name, hint, field(default=f.default)))
    return dataclasses.make_dataclass(name, fields)


def _optional_container(hint: Any) -> bool:
    """Whether ``hint`` is ``dict[K, V] | None`` or ``tuple[...] | None``."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return False
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return len(args) == 1 and typing.get_origin(args[0]) in (dict, tuple)


JobSchema = _schema_of(JobSpec, "JobSchema")
OptionsSchema = _schema_of(SimOptions, "OptionsSchema")


@dataclass
class SimSection:
    job: Any = field(default_factory=JobSchema)
    options: Any = field(default_factory=OptionsSchema)
    predictor: Any = None


@dataclass
class OutputConfig:
    csv: str = "results.csv"
    markdown: str = "results.md"
    plots: bool = True


@dataclass
class TraceOptions:
    """How the selected traces are read, where a file does not say (``load_trace``'s)."""

    convention: str = "auto"  # {metadata, data} JSON: auto | up | inverted (1 = preempted)
    capacity: int | None = None  # VMs requested (count and event traces)
    step_seconds: float | None = None  # resampling step of event traces (default 60 s)


@dataclass
class SimAppConfig:
    """Primary config of ``pcframe-sim`` (``conf/sim.yaml``)."""

    sim: SimSection = field(default_factory=SimSection)
    policy: Any = None
    traces: str = "all"
    trace_options: TraceOptions = field(default_factory=TraceOptions)
    baselines: list[str] = field(default_factory=list)
    label: str | None = None
    output: OutputConfig = field(default_factory=OutputConfig)
    progress: bool = True


def register_schemas() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="sim_app_schema", node=SimAppConfig)
    store.store(group="sim/job", name="job_schema", node=JobSchema, package="sim.job")


# --- building -----------------------------------------------------------------------------
def trace_options(cfg: DictConfig) -> dict[str, Any]:
    """``trace_options`` as :func:`~pcframe.policies.traces.load_trace` takes them, checked."""
    options = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(options, dict)
    if options["convention"] not in ("auto", "up", "inverted"):
        raise SimConfigError(
            f"trace_options.convention={options['convention']!r}: give auto, up (values count "
            "VMs up) or inverted (1 = preempted)"
        )
    if options["capacity"] is not None and options["capacity"] < 1:
        raise SimConfigError(
            f"trace_options.capacity={options['capacity']}: give the VMs the job asked for "
            "(>= 1), or null to read it from each trace"
        )
    step = options["step_seconds"]
    if step is not None and not (0 < step < math.inf):
        raise SimConfigError(
            f"trace_options.step_seconds={step}: give the seconds per tick (> 0) an event "
            "trace is resampled to, or null for 60"
        )
    return {k: v for k, v in options.items() if v is not None}


def build_job(cfg: DictConfig) -> JobSpec:
    return JobSpec.from_dict(OmegaConf.to_container(cfg, resolve=True), "sim.job")


def build_options(cfg: DictConfig) -> SimOptions:
    return SimOptions.from_dict(OmegaConf.to_container(cfg, resolve=True), "sim.options")


def _factory(node: Any, where: str) -> Any:
    """A fresh object per call (policies and predictors learn while they run). A value the
    object refuses is a :class:`SimConfigError` naming its config key (``where`` and the
    node Hydra reports) and the refusal, once."""
    if node is None:
        return None
    container = OmegaConf.to_container(node, resolve=True)

    def make(trace: Trace) -> Any:
        del trace
        try:
            return instantiate(container)
        except InstantiationException as exc:
            cause = exc.__cause__
            if cause is None or isinstance(cause, OmegaConfBaseException):
                raise
            inner = re.search(r"full_key: (\S+)", str(exc))
            key = f"{where}.{inner.group(1)}" if inner else where
            raise SimConfigError(f"{key}: {type(cause).__name__}: {cause}") from exc

    return make


def cases_from_config(cfg: DictConfig, traces: Sequence[Trace]) -> list[Case]:
    """One case per trace for the configured policy, plus one per requested baseline."""
    job = build_job(cfg.sim.job)
    options = build_options(cfg.sim.options)
    unknown = [b for b in cfg.baselines if b not in BASELINES]
    if unknown:
        raise SimConfigError(
            f"baselines={list(cfg.baselines)}: unknown {unknown}; choose from {list(BASELINES)}"
        )
    interval_node = cfg.policy.get("interval") if cfg.policy is not None else None
    if interval_node is None:
        raise SimConfigError("policy.interval is missing; pick one, e.g. policy/interval=daly")
    interval = _factory(interval_node, "policy.interval")
    resource = _factory(cfg.policy.get("resource"), "policy.resource")
    placement = _factory(cfg.policy.get("placement"), "policy.placement")
    if job.restart_by_tier and placement is None:
        raise SimConfigError(
            "sim.job.restart_by_tier needs a placement policy to say which tiers hold each "
            "version: add policy/placement=peers_then_remote (or another placement)"
        )
    predictor = _factory(cfg.sim.predictor, "sim.predictor")
    label = cfg.label or str(interval_node.get("_target_", "policy")).rsplit(".", 1)[-1]
    params = {**job.to_dict(), "seed": options.seed}
    if job.restart_by_tier is not None:  # one CSV cell, readable: {"peers": 420.0, ...}
        params["restart_by_tier"] = json.dumps(job.restart_by_tier, sort_keys=True)
    if job.measured_starts is not None:  # one CSV cell: [[2.5, 1.0], ...]
        params["measured_starts"] = json.dumps(job.measured_starts)
    cases = []
    for trace in traces:
        common = dict(
            trace=trace,
            job=job,
            resource=resource,
            predictor=predictor,
            options=options,
            params=params,
            placement=placement,
        )
        cases.append(Case(label=label, interval=interval, **common))
        if "oracle" in cfg.baselines:
            cases.append(Case(label="oracle", interval=lambda t: Oracle(), **common))
        if BEST_FIXED in cfg.baselines:
            cases.append(Case(label=BEST_FIXED, interval=BEST_FIXED, **common))
    return cases


def run_config(cfg: DictConfig, cwd: str | Path | None = None) -> list[SimResult]:
    traces = select_traces(cfg.traces, cwd, **trace_options(cfg.trace_options))
    return run_cases(cases_from_config(cfg, traces), progress=cfg.progress)


# --- outputs ------------------------------------------------------------------------------
# What the columns mean: results.md's legend, results.meta.json, the terminal's legend.
COLUMN_HELP = {
    "trace": "the trace (file name; a count trace also gives its VMs)",
    "source": "the trace's collection (skynomad, bamboo, pccheck, ...)",
    "label": "the policy; oracle = saves just before each preemption (an upper bound), "
    "best_fixed = the best FixedSteps interval in hindsight",
    "interval_policy": "the interval policy's config name",
    "resource_policy": "the resource policy's config name",
    "wall_hours": "simulated wall time",
    "useful_steps": "training steps that survived (durable progress at the end)",
    "lost_steps": "steps rolled back by preemptions",
    "goodput": "useful steps per wall second",
    "goodput_ratio": "goodput / the ideal (job.vms VMs always up, no checkpoint, no "
    "restart): 1.0 is perfect for a job on job.vms VMs; a resource policy that runs more "
    "VMs can exceed it",
    "efficiency": "useful time / wall time",
    "useful_hours": "wall hours of steps that survived",
    "lost_hours": "wall hours of work lost to preemptions",
    "stall_hours": "wall hours training was blocked by checkpoints",
    "restart_hours": "wall hours of VMs booting and restoring",
    "waiting_hours": "wall hours with no VM to run on",
    "cost": "dollars, spot + on-demand (n/a: the trace has no prices; set sim.options.spot_price)",
    "spot_cost": "dollars on spot VMs",
    "on_demand_cost": "dollars on on-demand VMs",
    "steps_per_dollar": "useful steps per dollar",
    "dollars_per_kstep": "dollars per 1000 useful steps",
    "spot_vm_hours": "VM hours on spot",
    "on_demand_vm_hours": "VM hours on demand",
    "preemptions": "preemptions that hit the job",
    "starts": "processes started (the first and every restart)",
    "changeovers": "planned VM changes by the resource policy",
    "saves": "checkpoints started",
    "saves_lost": "checkpoints still in flight when a preemption hit",
    "emergency_saves": "checkpoints saved on a preemption notice",
    "finished": "the job completed sim.job.total_steps; with total_steps null (the "
    "default) the job trains for the whole trace and never 'finishes', so this is no",
    "finish_hours": "when the last step was durable (total_steps set)",
    "deadline_met": "finished by sim.job.deadline (empty without a deadline)",
    "sim_seconds": "CPU seconds the simulation took",
    "placement_policy": "the placement policy (policy/placement): where each version goes, "
    "hence which versions survive a preemption",
    "job": "the sweep job the row comes from",
}
PARAM_HELP = "p_<key>: the job parameter sim.job.<key> (and the seed) of the row"
RESTORES_HELP = (
    "restores_<tier>: starts that restored from that tier, those preempted while starting "
    "included (with a placement)"
)

# Shorter headers for the terminal table.
SHORT = {
    "goodput_ratio": "goodput/ideal",
    "goodput": "steps/s",
    "useful_hours": "useful h",
    "lost_hours": "lost h",
    "stall_hours": "stall h",
    "restart_hours": "restart h",
    "waiting_hours": "waiting h",
    "preemptions": "preempt.",
    "dollars_per_kstep": "$/kstep",
    "cost": "cost $",
    "label": "policy",
}
# Terminal columns in order of priority: as many as fit the terminal's width.
TERMINAL_COLUMNS = (
    "trace",
    "label",
    "goodput_ratio",
    "preemptions",
    "saves",
    "lost_hours",
    "stall_hours",
    "restart_hours",
    "goodput",
    "cost",
    "waiting_hours",
    "useful_hours",
)


def applicable_columns(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> list[str]:
    """``columns`` without those that say nothing for these rows: ``finished`` when no job has
    ``total_steps`` (it would be "no" everywhere), ``deadline_met`` without a deadline."""

    def all_none(key: str) -> bool:
        return all(row.get(key) is None for row in rows)

    drop = set()
    if all_none("p_total_steps"):
        drop |= {"finished", "finish_hours"}
    if all_none("p_deadline"):
        drop.add("deadline_met")
    return [c for c in columns if c not in drop]


def legend(columns: Sequence[str]) -> list[str]:
    """``"column: meaning"`` lines for ``columns``."""
    lines = [f"{c}: {COLUMN_HELP[c]}" for c in columns if c in COLUMN_HELP]
    if any(c.startswith("p_") for c in columns):
        lines.append(PARAM_HELP)
    if any(c.startswith("restores_") for c in columns):
        lines.append(RESTORES_HELP)
    return lines


def _prefix_help(column: str) -> str:
    if column.startswith("p_"):
        return PARAM_HELP
    return RESTORES_HELP if column.startswith("restores_") else ""


def write_outputs(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, output: Any, header: str = ""
) -> list[Path]:
    """Plain CSV, Markdown table with a legend, a JSON sidecar and (optionally) plots.

    ``header`` (the command that produced the rows) goes into the sidecar
    ``<csv stem>.meta.json`` and the Markdown title, never into the CSV: the CSV's first
    line is its header row, as ``csv.DictReader`` and spreadsheets expect.
    """
    out = Path(out_dir)
    csv_path = write_csv(rows, out / output.csv)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    meta = csv_path.with_name(f"{csv_path.stem}.meta.json")
    meta.write_text(
        json.dumps(
            {
                "command": header,
                "rows": len(rows),
                "csv": csv_path.name,
                "columns": {c: COLUMN_HELP.get(c, _prefix_help(c)) for c in columns},
            },
            indent=2,
        )
        + "\n"
    )
    written = [csv_path, meta]
    md = out / output.markdown
    title = "# pcframe-sim results\n\n" + (f"{markdown_code(header)}\n\n" if header else "")
    shown = applicable_columns(rows, TABLE_COLUMNS)
    if "job" in columns:
        shown = ["job", *shown]
    explained = "\n".join(f"- {line}" for line in legend(shown))
    md.write_text(title + markdown_table(rows, shown) + "\nColumns:\n\n" + explained + "\n")
    written.append(md)
    if output.plots and rows:
        written.append(plot_grouped_bars(rows, out / "goodput.png", title="goodput / ideal"))
        written.append(plot_breakdown(rows, out / "breakdown.png", title="where the time went"))
    return written


def terminal_columns(rows: Sequence[dict[str, Any]], width: int) -> list[str]:
    """The columns of :data:`TERMINAL_COLUMNS` that fit in ``width`` characters, in priority
    order (trace and policy always)."""
    from pcframe.sim.report import fmt

    def need(column: str) -> int:
        cells = [len(fmt(row.get(column))) for row in rows] or [0]
        return max(len(SHORT.get(column, column)), *cells) + 3  # padding and border

    chosen: list[str] = []
    used = 1
    for column in applicable_columns(rows, TERMINAL_COLUMNS):
        cost = need(column)
        if column in ("trace", "label") or used + cost <= width:
            chosen.append(column)
            used += cost
    return chosen


def results_rows(results: Sequence[SimResult]) -> list[dict[str, Any]]:
    """CSV rows of ``results`` (one per simulation)."""
    return rows_of(results)


class AggregateSweep(Callback):
    """After a ``--multirun``: merge every job's CSV into one CSV, table and plots."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        rows: list[dict[str, Any]] = []
        for path in sorted(sweep.glob(f"*/{config.output.csv}")):
            job_rows = read_csv(path)
            for row in job_rows:
                row["job"] = path.parent.name
            rows += job_rows
        if rows:
            output = OmegaConf.create(
                {"csv": f"sweep_{config.output.csv}", "markdown": "sweep_results.md", "plots": True}
            )
            write_outputs(rows, sweep, output, header=f"{len(rows)} rows from {sweep}")
            jobs = len({r["job"] for r in rows})
            print(f"wrote {sweep / output.csv} ({len(rows)} rows from {jobs} jobs)")
