"""Results of a study: a Markdown table, a plot, and the tuned engine config as YAML."""

from __future__ import annotations

import datetime as dt
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.trial import FrozenTrial, TrialState

from pcframe.apps.limits import MachineLimits
from pcframe.apps.machine import machine_differences, machine_identity
from pcframe.apps.tuning.target_storage import target_differences
from pcframe.config import EngineConfig
from pcframe.text import markdown_row

META_PREFIX = "# pcframe-tune-meta: "

UNITS = {
    "overhead": ("overhead %", 100.0),
    "stall": ("stall ms", 1e3),
    "cpu": ("cpu ms", 1e3),
    "cost": ("cost ms", 1e3),
    "lost": ("lost ms", 1e3),
    "memory": ("MiB", 2**-20),
}
ATTRS = {
    "overhead": "overhead",
    "stall": "stall_s",
    "cpu": "cpu_s",
    "cost": "cost_s",
    "lost": "lost_s",
}


def groups(study: optuna.Study) -> list[list[FrozenTrial]]:
    """Completed trials grouped by identical parameters (a configuration measured n times)."""
    by_params: dict[tuple, list[FrozenTrial]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        by_params.setdefault(tuple(sorted(t.params.items())), []).append(t)
    return list(by_params.values())


def mean_value(trials: Sequence[FrozenTrial]) -> float:
    return statistics.fmean(t.values[0] for t in trials)


def best_trial(study: optuna.Study, objectives: Sequence[str]) -> FrozenTrial:
    """The single best trial.

    One objective: among configurations measured more than once (see ``tune.confirm``), the
    one with the best mean; if none was, the best single measurement. A single noisy
    measurement tends to flatter the configuration that wins the search (the winner's
    curse); measuring the leaders again keeps a lucky draw from being picked.
    Several objectives: the Pareto trial best on the first objective.
    """
    if len(objectives) == 1:
        measured = groups(study)
        if not measured:
            raise ValueError(f"study {study.study_name!r} has no completed trial yet")
        pool = [g for g in measured if len(g) > 1] or measured
        return min(min(pool, key=mean_value), key=lambda t: t.values[0])
    front = study.best_trials
    if not front:
        raise ValueError(f"study {study.study_name!r} has no completed trial yet")
    return min(front, key=lambda t: tuple(t.values))


def limit_lines(best: FrozenTrial, limits: MachineLimits | None) -> list[str]:
    """The best trial's stall and time to durable beside the machine's limits.

    A stall can be no shorter than one memcpy of the checkpoint (with nothing to overlap),
    a version no sooner durable than the disk writes it: the ratios say how much is left.
    """
    if limits is None:
        return ["machine limits not measured: the best trial recorded no checkpoint size"]
    attrs = best.user_attrs
    nbytes = int(attrs["checkpoint_bytes"])
    memcpy, disk = limits.memcpy_seconds(nbytes), limits.disk_seconds(nbytes)
    lines = [f"machine limits (measured now, {nbytes / 1e6:.0f} MB): " + "; ".join(limits.lines())]
    stall, durable = attrs.get("stall_s"), attrs.get("durable_s")
    if stall is not None:
        lines.append(
            f"best stall {stall * 1e3:.2f} ms per checkpoint = {stall / memcpy:.2f}x one memcpy "
            f"of it ({memcpy * 1e3:.2f} ms)"
        )
    if durable:
        lines.append(
            f"best time to durable {durable * 1e3:.0f} ms = {durable / disk:.2f}x what the disk "
            f"needs to write it ({disk * 1e3:.0f} ms)"
        )
    return lines


def _in_unit(name: str, value: float | None) -> str:
    """An objective's value in its display unit (``UNITS``), two decimals; ``""`` if missing."""
    if value is None:
        return ""
    _, scale = UNITS.get(name, (name, 1.0))
    return f"{value * scale:.2f}"


def trials_table(study: optuna.Study, objectives: Sequence[str], limit: int = 50) -> str:
    """Markdown table of finished trials, best first (pruned and failed ones at the end)."""
    trials = [t for t in study.trials if t.state != TrialState.RUNNING]
    done = sorted(
        (t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: tuple(t.values)
    )
    rest = [t for t in trials if t.state != TrialState.COMPLETE]
    names = sorted({p for t in trials for p in t.params})
    columns = ["trial", "state"]
    columns += [UNITS.get(o, (o, 1))[0] for o in objectives]
    extra = [m for m in UNITS if m not in objectives]
    columns += [UNITS[m][0] for m in extra] + names
    lines = [markdown_row(columns), "|" + "---|" * len(columns)]
    for t in [*done, *rest][:limit]:
        measured = {name: t.user_attrs.get(attr) for name, attr in ATTRS.items()}
        measured["memory"] = t.user_attrs.get("memory_bytes")
        values = list(t.values) if t.values else [measured.get(o) for o in objectives]
        row = [str(t.number), t.state.name.lower()]
        row += [_in_unit(o, v) for o, v in zip(objectives, values, strict=True)]
        row += [_in_unit(m, measured[m]) for m in extra]
        row += [str(t.params.get(n, "")) for n in names]
        lines.append(markdown_row(row))
    return "\n".join(lines) + "\n"


def plot(study: optuna.Study, objectives: Sequence[str], path: str | Path) -> Path:
    """Objective per trial with the best so far (one objective), or the Pareto front (two+)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if len(objectives) == 1:
        label, scale = UNITS.get(objectives[0], (objectives[0], 1.0))
        xs = [t.number for t in done]
        ys = [t.values[0] * scale for t in done]
        ax.scatter(xs, ys, s=18, label="completed trial")
        pruned = [
            t for t in study.trials if t.state == TrialState.PRUNED and t.last_step is not None
        ]
        if pruned:
            ax.scatter(
                [t.number for t in pruned],
                [t.intermediate_values[t.last_step] * scale for t in pruned],
                marker="x",
                color="grey",
                s=18,
                label="pruned (last report)",
            )
        best, running = [], float("inf")
        for y in ys:
            running = min(running, y)
            best.append(running)
        ax.step(xs, best, where="post", color="C3", label="best so far (single measurement)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("trial")
        ax.set_ylabel(label)
    else:
        (lx, sx), (ly, sy) = (UNITS.get(o, (o, 1.0)) for o in objectives[:2])
        front = {t.number for t in study.best_trials}
        for on_front, color in ((False, "C0"), (True, "C3")):
            pts = [t for t in done if (t.number in front) == on_front]
            ax.scatter(
                [t.values[0] * sx for t in pts],
                [t.values[1] * sy for t in pts],
                color=color,
                s=30 if on_front else 18,
                label="Pareto front" if on_front else "trial",
            )
        ax.set_xlabel(lx)
        ax.set_ylabel(ly)
    ax.set_title(f"pcframe-tune: {study.study_name}")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_tuned_config(
    path: str | Path,
    engine: EngineConfig,
    study: optuna.Study,
    trial: FrozenTrial,
    objectives: Sequence[str],
    *,
    workload: Mapping[str, Any] | None = None,
    threads: int | None = None,
    target: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``engine`` as an ``engine`` group option (``pcframe-run engine=<file stem>``).

    The header records what it was tuned for: the workload (name and arguments), the torch
    threads, this machine (:func:`~pcframe.apps.machine.machine_identity`) and the target
    (:meth:`~pcframe.apps.tuning.target_storage.ActiveTarget.identity`: its name, the storage
    directory's device and file system, a blkio throttle, a remote tier), as readable
    comments and as one ``# pcframe-tune-meta: {json}`` line that ``pcframe-run`` compares
    with its own setup (:func:`tuned_config_warnings`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    values = ", ".join(
        f"{UNITS.get(o, (o, 1))[0]} {_in_unit(o, v)}"
        for o, v in zip(objectives, trial.values, strict=True)
    )
    if len(objectives) == 1:
        same = next(g for g in groups(study) if trial in g)
        values += (
            f" (mean of {len(same)} measurement(s): {_in_unit(objectives[0], mean_value(same))})"
        )
    machine = machine_identity()
    meta = {
        "study": study.study_name,
        "trial": trial.number,
        "written": dt.datetime.now().isoformat(timespec="seconds"),
        "workload": dict(workload) if workload is not None else None,
        "threads": threads,
        "machine": machine,
        "target": dict(target) if target is not None else None,
    }
    tuned_for = (f"workload {describe_workload(workload)}, " if workload is not None else "") + (
        f"{machine['cpus']} CPUs ({machine['cpu']}), {machine['memory_gib']} GiB, "
        f"host {machine['host']}"
    )
    if target is not None:
        tuned_for += f"; target {describe_target(target)}"
    header = [
        f"# Written by pcframe-tune on {meta['written']}.",
        f"# Study {study.study_name!r}, trial {trial.number}: {values}.",
        f"# Tuned for {tuned_for}.",
        f"# Use it with: pcframe-run engine={path.stem}   (searched in $PCFRAME_CONFIG_DIR,",
        "# default ./pcframe-conf; see docs/tuning.md). pcframe-run warns when its workload,",
        "# machine or storage target differs from the one recorded here.",
        META_PREFIX + json.dumps(meta, sort_keys=True),
    ]
    body = OmegaConf.create({"defaults": ["engine_schema", "_self_"], **engine.to_dict()})
    path.write_text("\n".join(header) + "\n" + OmegaConf.to_yaml(body))
    return path


def describe_target(target: Mapping[str, Any]) -> str:
    """``throttled (ext4 on 254:0, write limit 50 MiB/s)`` for a recorded target."""
    parts = [f"{target.get('fs_type') or '?'} on {target.get('device') or '?'}"]
    for key, label in (("write_bps", "write limit"), ("read_bps", "read limit")):
        if target.get(key):
            parts.append(f"{label} {target[key] / 2**20:.0f} MiB/s")
    if target.get("remote"):
        parts.append(f"remote {target['remote']}")
    return f"{target.get('name')} ({', '.join(parts)})"


def describe_workload(workload: Mapping[str, Any] | None) -> str:
    if not workload:
        return "?"
    args = workload.get("args") or {}
    shown = ", ".join(f"{k}={v}" for k, v in args.items())
    return f"{workload.get('name')}({shown})"


def read_tuned_meta(path: str | Path) -> dict[str, Any] | None:
    """The ``# pcframe-tune-meta:`` record of a tuned config (``None``: not from the tuner)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(META_PREFIX):
                return json.loads(line[len(META_PREFIX) :])
            if not line.startswith("#"):
                break
    except (OSError, ValueError):
        return None
    return None


def option_file(hydra_cfg: Any, group: str, option: str) -> Path | None:
    """The YAML file an option was loaded from, if it came from a folder on disk."""
    for source in hydra_cfg.runtime.config_sources:
        if source.get("schema") == "file":
            candidate = Path(source.path) / group / f"{option}.yaml"
            if candidate.is_file():
                return candidate
    return None


def tuned_config_warnings(cfg: DictConfig, hydra_cfg: Any) -> list[str]:
    """Warnings when the selected engine option was tuned for another workload or machine."""
    choice = hydra_cfg.runtime.choices.get("engine")
    path = option_file(hydra_cfg, "engine", choice) if choice else None
    meta = read_tuned_meta(path) if path is not None else None
    if not meta:
        return []
    problems = []
    tuned = meta.get("workload")
    here = {"name": cfg.workload.name, "args": OmegaConf.to_container(cfg.workload.args)}
    if tuned and tuned.get("name") != here["name"]:
        problems.append(f"workload {tuned.get('name')} there, {here['name']} here")
    elif tuned:
        there_args, here_args = tuned.get("args") or {}, here["args"] or {}
        problems += [
            f"workload.args.{k} {there_args.get(k)!r} there, {here_args.get(k)!r} here"
            for k in sorted(set(there_args) | set(here_args))
            if there_args.get(k) != here_args.get(k)
        ]
    problems += machine_differences(meta.get("machine") or {}, machine_identity())
    target = meta.get("target")
    storage = target_differences(target, cfg.storage.directory) if target else []
    if not problems and not storage:
        return []
    fix = "run pcframe-tune with this workload on this machine to tune for it"
    if storage:
        fix = (
            "run pcframe-tune with storage.directory on this run's storage (and the "
            "tune/target preset that matches it) to tune for it"
        )
    return [
        f"engine={choice} ({path}) was tuned for another setup: "
        f"{'; '.join(problems + storage)}. Its values may not suit this one; {fix}"
    ]
