"""The Markdown, heat map and importance plots of ``tune_matrix.py`` (see its docstring)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt
import optuna
import torch

from pcframe.config import EngineConfig

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

NOTES = Path(__file__).with_name("tune_matrix_notes.md")
AT_LIMIT = 0.85  # a run that uses this much of its storage's rate is storage-bound


def stats(rows: list[dict[str, float]], key: str, scale: float = 1e3) -> tuple[float, ...]:
    values = [r[key] * scale for r in rows]
    return statistics.median(values), min(values), max(values)


def storage_use(row: dict[str, float], limit: Any) -> float:
    """Share of the target's write (or PUT) rate the checkpointed segment used."""
    per_checkpoint = row["checkpoint_step_s"] * row["interval_s"] / row["baseline_step_s"]
    return row["checkpoint_bytes"] / limit.write_bps / per_checkpoint


def verdict(run: Any) -> dict[str, Any]:
    """Own tuned config vs the best and vs the default on this target (min-max ranges)."""
    lost = {name: stats(rows, "lost_s") for name, rows in run.cells.items()}
    best = min(lost, key=lambda n: lost[n][0])
    own = f"tuned@{run.name}"
    d_use = statistics.median(storage_use(r, run.limit) for r in run.cells["default"])
    found = {"best": best, "own": own, "lost": lost, "default_use": d_use}
    if own not in lost:
        return found
    found["own_best"] = own == best or lost[own][1] <= lost[best][2]  # ranges overlap
    found["beats_default"] = lost[own][2] < lost["default"][1]
    found["default_at_limit"] = d_use >= AT_LIMIT
    found["gain"] = lost["default"][0] / lost[own][0] if lost[own][0] > 0 else float("nan")
    return found


def importances(study: optuna.Study) -> dict[str, float]:
    try:
        return optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError):  # too few distinct trials
        return {}


def write_report(out, command, runs, engines, speedup, total_s, workload, args) -> None:
    done = [r for r in runs.values() if r.refused is None]
    names = list(engines)
    title = "Tuned for a target, best on that target: the cross-matrix"
    lines = [
        *header(title, command, f"{total_s / 60:.1f} min in all"),
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (shared with other work), "
        f"torch {torch.__version__}, 1 torch thread; load average at the end "
        f"{os.getloadavg()[0]:.1f}. Workload `{' '.join(workload)}` "
        f"({_nbytes(done) / 1e6:.1f} MB checkpoint). Study per target: `tune=matrix`, "
        f"{args.trials} trials + confirmations, objective `lost`; each cell: {args.repeats} "
        "measurements in rotating order (median, min–max).",
        "",
        "`lost` = stall + engine CPU + drain per checkpoint: the training thread's blocked "
        "time, the CPU seconds the engine's threads took, and the wait at a segment's end "
        "for storage to catch up (durable locally, and uploaded for s3), spread over its "
        "checkpoints (pcframe.apps.tuning.measure). Lower is better.",
        "",
        "## Targets and their limits",
        "",
    ]
    targets = []
    for run in runs.values():
        if run.refused is not None:
            targets.append([run.name, f"refused: {run.refused}", "", "", ""])
            continue
        lim = run.limit
        targets.append(
            [
                run.name,
                _setup(run.name),
                f"{run.tuning_s:.0f} s",
                f"{lim.memcpy_bps / 1e9:.1f} GB/s",
                f"{lim.what}: {lim.write_bps / 1e6:.0f} MB/s "
                f"({lim.write_low / 1e6:.0f}–{lim.write_high / 1e6:.0f})",
            ]
        )
    columns = ["target", "setup", "tuning wall", "memcpy", "storage limit (median, min–max)"]
    lines += table_lines(columns, targets)
    lines += _probe_lines(runs)
    lines += ["", "## The matrix: lost ms per checkpoint", ""]
    lines += _table(done, names, lambda run, n: _cell(run, n, "lost_s"))
    lines += [
        "",
        "Share of the target's storage limit used by the checkpointed segment (checkpoint "
        "bytes ÷ limit rate ÷ wall time per checkpoint; near 1: storage-bound, no knob can "
        "buy more):",
        "",
    ]
    lines += _table(
        done,
        names,
        lambda run, n: f"{statistics.median(storage_use(r, run.limit) for r in run.cells[n]):.2f}",
    )
    lines += ["", "Stall ms per checkpoint (and ÷ one memcpy of the checkpoint):", ""]
    lines += _table(done, names, _stall_cell)
    lines += ["", "Host staging memory (MiB):", ""]
    lines += _table(done, names, lambda run, n: f"{run.cells[n][0]['memory_bytes'] / 2**20:.0f}")
    lines += ["", "## Verdict per target", ""]
    for run in done:
        lines.append(f"- **{run.name}**: {_verdict_text(run)}")
    lines += ["", "## The tuned configurations", ""]
    lines += _knob_table(engines)
    lines += ["", "## What the tuner learned", ""]
    for run in done:
        if run.study is None:
            continue
        imp = importances(run.study)
        shown = ", ".join(f"{k} {v:.2f}" for k, v in list(imp.items())[:4]) or "n/a"
        lines.append(
            f"- **{run.name}**: parameter importances (Optuna fANOVA, "
            f"`get_param_importances`): {shown}; plot `tune_matrix_importance_{run.name}.png`"
        )
        _importance_plot(run, out / f"tune_matrix_importance_{run.name}.png")
    if NOTES.is_file():
        lines += ["", NOTES.read_text().strip()]
    if speedup:
        lines += ["", *_speedup_lines(speedup)]
    lines += [
        "",
        "Heat map: `tune_matrix.png` (each row divided by its best cell; the diagonal "
        "frame is a target's own tuned config).",
        "",
    ]
    write_results(out / "tune_matrix.md", "\n".join(lines))
    raw = {
        "command": command,
        "engines": {n: e.to_dict() for n, e in engines.items()},
        "targets": {
            r.name: {
                "refused": r.refused,
                "limit": None if r.limit is None else vars(r.limit),
                "cells": r.cells,
                "importances": importances(r.study) if r.study is not None else {},
            }
            for r in runs.values()
        },
        "workers": speedup,
    }
    (out / "tune_matrix.json").write_text(json.dumps(raw, indent=1, default=str))
    _heat_map(done, names, out / "tune_matrix.png")
    print("\n".join(lines))


def _nbytes(done) -> float:
    for run in done:
        for rows in run.cells.values():
            return rows[0]["checkpoint_bytes"]
    return 0.0


def _setup(name: str) -> str:
    return {
        "disk": "/var/tmp (ext4 on /dev/vda), as it is",
        "throttled": "same disk, blkio cgroup v1: 50 MiB/s write and read on 254:0, "
        "this process inside",
        "tmpfs": "/dev/shm",
        "s3": "primary /dev/shm + remote tier on a moto S3 server on loopback",
    }.get(name, name)


def _probe_lines(runs) -> list[str]:
    run = runs.get("throttled")
    if run is None or not run.probe:
        return []
    lines = ["", "What the blkio throttle limits (`throttle.probe_throttle`, 32 MiB each):", ""]
    rows = list(zip(*(p.lines() for p in run.probe.values()), strict=True))
    cells = [[row[0].split(":")[0], *(r.split(": ")[1] for r in row)] for row in rows]
    return lines + table_lines(["I/O", *run.probe], cells)


def _table(done, names, cell) -> list[str]:
    rows = [[run.name, *(cell(run, n) for n in names)] for run in done]
    return table_lines(["target \\ config", *names], rows)


def _cell(run, name: str, key: str) -> str:
    med, lo, hi = stats(run.cells[name], key)
    own = name == f"tuned@{run.name}"
    text = f"{med:.1f} ({lo:.1f}–{hi:.1f})"
    return f"**{text}**" if own else text


def _stall_cell(run, name: str) -> str:
    med, lo, hi = stats(run.cells[name], "stall_s")
    memcpy = run.cells[name][0]["checkpoint_bytes"] / run.limit.memcpy_bps * 1e3
    return f"{med:.1f} ({lo:.1f}–{hi:.1f}) = {med / memcpy:.0f}x"


def _verdict_text(run) -> str:
    v = verdict(run)
    own, best, lost = v["own"], v["best"], v["lost"]
    if "own_best" not in v:
        return "no tuned config of its own"
    parts = [
        f"own tuned {lost[own][0]:.1f} ms, best {best} {lost[best][0]:.1f} ms: "
        + (
            "**best**"
            if own == best
            else "within noise of the best"
            if v["own_best"]
            else "**not** the best beyond noise"
        ),
        f"default {lost['default'][0]:.1f} ms ({v['gain']:.2f}x the tuned cost): "
        + (
            "tuned **beats it beyond noise** (ranges apart)"
            if v["beats_default"]
            else "not beyond noise"
        ),
        f"the default uses {v['default_use']:.2f} of the storage limit"
        + (" (storage-bound: at the limit)" if v["default_at_limit"] else ""),
    ]
    return "; ".join(parts)


def _knob_table(engines: dict[str, EngineConfig]) -> list[str]:
    dicts = {n: e.to_dict() for n, e in engines.items()}
    keys = [k for k in dicts["default"] if len({repr(d[k]) for d in dicts.values()}) > 1]
    rows = [[k, *(_short(d[k]) for d in dicts.values())] for k in keys]
    return table_lines(["knob", *dicts], rows)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, int) and value >= 1 << 20:
        return f"{value >> 20} MiB"
    return str(value) if value != {} else "raw"


def _importance_plot(run, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
        try:
            ax = optuna.visualization.matplotlib.plot_param_importances(run.study)
        except (RuntimeError, ValueError):
            return
    ax.set_title(f"Importances for lost ms: {run.name}", loc="left")
    ax.figure.set_size_inches(7, 4)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=110)
    plt.close(ax.figure)


def _speedup_lines(s: dict[str, Any]) -> list[str]:
    one, two = s[1], s[2]
    return [
        "## Several workers on one study",
        "",
        f"The same budget of {s['trials']} trials on the disk target (`tune=matrix`, "
        "`tune.confirm=0`, journal storage), run by 1 `pcframe-tune` process and then by 2 "
        "on the same journal file, on this 2-core machine:",
        "",
        *table_lines(
            [
                "workers",
                "wall (processes started to all exited)",
                "first trial start to last trial end",
                "trials",
                "per worker",
                "best lost ms",
            ],
            [
                [
                    w,
                    f"{s[w]['wall_s']:.1f} s",
                    f"{s[w]['trials_span_s']:.1f} s",
                    s[w]["finished"],
                    ", ".join(map(str, s[w]["per_worker"].values())),
                    f"{s[w]['best_lost_ms']:.1f}",
                ]
                for w in (1, 2)
            ],
        ),
        "",
        f"Speed-up of 2 workers: {one['wall_s'] / two['wall_s']:.2f}x wall, "
        f"{one['trials_span_s'] / two['trials_span_s']:.2f}x over the trials.",
    ]


def _heat_map(done, names, path: Path) -> None:
    data, text = [], []
    for run in done:
        meds = {n: stats(run.cells[n], "lost_s")[0] for n in names}
        best = min(meds.values())
        data.append([meds[n] / best for n in names])
        text.append([f"{meds[n]:.0f} ms\n{meds[n] / best:.2f}x" for n in names])
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 0.9 * len(done) + 1.6))
    top = max(2.0, max(map(max, data)))
    image = ax.imshow(data, cmap="viridis_r", vmin=1.0, vmax=top)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_yticks(range(len(done)), [f"on {r.name}" for r in done])
    for i, row in enumerate(text):
        for j, label in enumerate(row):
            dark = data[i][j] > 1.0 + (top - 1.0) / 2  # viridis_r: high ratios are dark
            ax.text(
                j,
                i,
                label,
                ha="center",
                va="center",
                fontsize=8,
                color="white" if dark else "black",
            )
        own = f"tuned@{done[i].name}"
        if own in names:
            j = names.index(own)
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2.5, ec="red"))
    fig.colorbar(image, ax=ax, label="lost per checkpoint ÷ best on the target")
    ax.set_title("pcframe-tune: tuned config (column) measured on target (row)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
