"""Results on disk: CSV rows, Markdown tables, PNG plots (matplotlib, headless)."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pcframe.sim.result import BREAKDOWN, SimResult
from pcframe.text import markdown_row


def rows_of(results: Iterable[SimResult]) -> list[dict[str, Any]]:
    return [r.row() for r in results]


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path, header: str = "") -> Path:
    """Rows as CSV (columns: union of keys, first-seen order); ``header`` lines as comments."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with path.open("w", newline="") as f:
        for line in header.splitlines():
            f.write(f"# {line}\n")
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in columns})
    return path


def _csv_value(x: Any) -> Any:
    if isinstance(x, float):
        return f"{x:.10g}"
    return "" if x is None else x


def read_csv(path: str | Path) -> list[dict[str, Any]]:
    """Rows written by :func:`write_csv`, numbers parsed back (comments skipped)."""
    with Path(path).open(newline="") as f:
        lines = [ln for ln in f if not ln.startswith("#")]
    return [{k: _parse(v) for k, v in row.items()} for row in csv.DictReader(lines)]


def _parse(value: str) -> Any:
    if value == "":
        return None
    if value in ("True", "False"):
        return value == "True"
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return ""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "n/a"
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 10 ** (-digits)):
            return f"{x:.{digits}g}"
        return f"{x:,.{digits}f}"
    return str(x)


def markdown_table(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    headers: Sequence[str] | None = None,
    digits: int = 3,
    formats: dict[str, Callable[[Any], str]] | None = None,
) -> str:
    """A GitHub Markdown table of ``columns`` (text left, numbers right aligned); a ``|``,
    a newline or a control character in a header or a cell (a trace's name) stays in its
    cell (:func:`pcframe.text.markdown_cell`)."""
    headers = list(headers or columns)
    formats = formats or {}
    body = []
    for row in rows:
        body.append([formats.get(c, lambda x: fmt(x, digits))(row.get(c)) for c in columns])
    numeric = [
        all(isinstance(row.get(c), int | float) or row.get(c) is None for row in rows)
        for c in columns
    ]
    lines = [markdown_row(headers)]
    lines.append("|" + "|".join("---:" if n else "---" for n in numeric) + "|")
    lines += [markdown_row(cells) for cells in body]
    return "\n".join(lines) + "\n"


def pivot(
    rows: Sequence[dict[str, Any]], index: str, column: str, value: str
) -> tuple[list[Any], list[Any], dict[tuple[Any, Any], Any]]:
    """(index values, column values, {(i, c): value}) in first-seen order."""
    idx: list[Any] = []
    cols: list[Any] = []
    cells: dict[tuple[Any, Any], Any] = {}
    for row in rows:
        i, c = row[index], row[column]
        if i not in idx:
            idx.append(i)
        if c not in cols:
            cols.append(c)
        cells[(i, c)] = row.get(value)
    return idx, cols, cells


def pivot_table(
    rows: Sequence[dict[str, Any]], index: str, column: str, value: str, digits: int = 3
) -> str:
    """Markdown table with one row per ``index`` value and one column per ``column`` value."""
    idx, cols, cells = pivot(rows, index, column, value)
    table = [{index: i, **{str(c): cells.get((i, c)) for c in cols}} for i in idx]
    return markdown_table(table, [index] + [str(c) for c in cols], digits=digits)


# --- plots --------------------------------------------------------------------------------
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: experiments run without a display
    import matplotlib.pyplot as plt

    return plt


def plot_grouped_bars(
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    group: str = "trace",
    series: str = "label",
    value: str = "goodput_ratio",
    ylabel: str = "goodput / ideal",
    title: str = "",
) -> Path:
    """One group of bars per ``group`` value, one bar per ``series`` value."""
    plt = _pyplot()
    groups, names, cells = pivot(rows, group, series, value)
    width = 0.8 / max(len(names), 1)
    bars = len(groups) * max(len(names), 1)
    fig, ax = plt.subplots(figsize=(min(22.0, max(8.0, 2.0 + 0.09 * bars)), 5.2))
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(groups))]
        ys = [_num(cells.get((g, name))) for g in groups]
        ax.bar(xs, ys, width=width, label=_plain(name))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([_plain(g) for g in groups], rotation=40, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=min(len(names), 4))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_breakdown(
    rows: Sequence[dict[str, Any]], path: str | Path, by: str = "label", title: str = ""
) -> Path:
    """Stacked bars: where the wall time went (summed over the rows of each ``by`` value)."""
    plt = _pyplot()
    names: list[Any] = []
    sums: dict[Any, dict[str, float]] = {}
    for row in rows:
        name = row[by]
        if name not in sums:
            names.append(name)
            sums[name] = dict.fromkeys(BREAKDOWN, 0.0)
        for part in BREAKDOWN:
            sums[name][part] += _num(row.get(f"{part}_hours"))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names)), 4.5))
    bottom = [0.0] * len(names)
    for part in BREAKDOWN:
        total = [sum(sums[n].values()) or 1.0 for n in names]
        share = [sums[n][part] / t for n, t in zip(names, total, strict=True)]
        ax.bar(range(len(names)), share, bottom=bottom, label=part)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([_plain(n) for n in names], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("share of wall time")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


def plot_lines(
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=_plain(name))
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _plain(x: Any) -> str:
    """A label or trace name as matplotlib shows it literally: text between two ``$`` was
    mathtext (``cost $5 to $6`` in italics; ``$\\frac{$`` a ParseException after every
    simulation had run)."""
    return str(x).replace("$", r"\$")


def _num(x: Any) -> float:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else 0.0
