"""Find trace files, recognise their format from their content, load them as :class:`Trace`."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

from pcframe.policies.errors import TraceFormatError
from pcframe.policies.traces.events import read_bamboo_events, read_pccheck_gpus
from pcframe.policies.traces.native import (
    GIVEN_CAPACITY_FIX,
    read_pcframe_csv,
    read_pcframe_json,
)
from pcframe.policies.traces.schema import FORMAT_TAG, Trace
from pcframe.policies.traces.skynomad import Convention, read_availability_csv, read_node_json

ENV_VAR = "PCFRAME_TRACES"
FORMATS = (
    "skynomad-availability-csv",
    "skynomad-json",
    "bamboo-events",
    "pccheck-gpus",
    "pcframe-csv",
    "pcframe-json",
)
_BAMBOO_ROW = re.compile(r"^\d+,(add|remove),\S+$")
_NOT_TRACES = {"license", "notice", "readme"}


def shared_traces_dir() -> Path | None:
    """Where the shipped traces are: ``$PCFRAME_TRACES``, else the repository's copy in
    ``experiments/traces``, else ``../shared/traces`` beside the repository; ``None`` if none.
    """
    env = os.environ.get(ENV_VAR)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"${ENV_VAR}={env!r} is not a directory; unset or fix it")
        return path
    for root in _repo_roots():
        for candidate in (root / "experiments" / "traces", root.parent / "shared" / "traces"):
            if candidate.is_dir() and any(candidate.rglob("*.csv")):
                return candidate
    return None


def _repo_roots() -> list[Path]:
    """Folders holding a ``pyproject.toml``: above this file (editable install) and the CWD."""
    roots: list[Path] = []
    for start in (Path(__file__).resolve(), Path.cwd().resolve()):
        for parent in (start, *start.parents):
            if (parent / "pyproject.toml").is_file() and parent not in roots:
                roots.append(parent)
                break
    return roots


def detect_format(path: str | Path) -> str:
    """One of :data:`FORMATS`, judged from the content (not the name)."""
    path = Path(path)
    if path.suffix.lower() == ".json":
        doc = _read_json(path)
        return _json_format(path, doc)
    with path.open(newline="", encoding="utf-8-sig") as f:
        first = next((ln.strip() for ln in f if ln.strip()), "")
    if first.replace(" ", "") == "date,availability":
        return "skynomad-availability-csv"
    if first.replace(" ", "").endswith("Time,GPUs"):
        return "pccheck-gpus"
    if _BAMBOO_ROW.match(first):
        return "bamboo-events"
    if first.startswith("#") or first.replace(" ", "").lower().startswith("time,up"):
        return "pcframe-csv"
    raise TraceFormatError(
        path,
        "line 1",
        f"unknown trace format (first line {first[:60]!r})",
        "convert it to the pcframe CSV form (header 'time,up') or JSON form "
        f"(format {FORMAT_TAG!r}); see docs/policies.md",
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise TraceFormatError(
            path,
            f"line {exc.lineno} column {exc.colno}",
            f"invalid JSON: {exc.msg}",
            "repair the JSON syntax",
        ) from exc


def _json_format(path: Path, doc: Any) -> str:
    if isinstance(doc, dict) and doc.get("format") == FORMAT_TAG:
        return "pcframe-json"
    if isinstance(doc, dict) and "data" in doc and "metadata" in doc:
        return "skynomad-json"
    if isinstance(doc, dict) and doc and all(isinstance(v, list) for v in doc.values()):
        raise TraceFormatError(
            path,
            "",
            "this is a price table, not a trace",
            "load the availability CSVs beside it; their prices are attached automatically",
        )
    raise TraceFormatError(
        path,
        "top level",
        "JSON is neither a pcframe trace nor a {metadata, data} trace",
        f'add "format": "{FORMAT_TAG}" with step_seconds, capacity and up (docs/policies.md)',
    )


def load_trace(
    path: str | Path,
    *,
    format: str = "auto",
    capacity: int | None = None,
    convention: Convention = "auto",
    prices: Path | dict[str, list[float]] | Literal["auto"] | None = "auto",
    step_seconds: float | None = None,
) -> Trace:
    """Load one trace file in any supported format into the normalised :class:`Trace`.

    Args:
        path: the file.
        format: one of :data:`FORMATS`, or ``auto`` to recognise it from the content.
        capacity: VMs requested, over what the file says: node-count JSON, event traces
            and pcframe's CSV/JSON (every up-count must fit it). An availability CSV is
            capacity 1 (up: a spot VM could be had) whatever is given.
        convention: for ``{metadata, data}`` JSON: ``up`` (values count VMs up), ``inverted``
            (1 = preempted, the GCP H100 files) or ``auto``.
        prices: spot price table for availability CSVs (``auto``: the ``*price*.json`` beside).
        step_seconds: resampling step of event traces (default 60 s).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist")
    try:
        fmt = detect_format(path) if format == "auto" else format
        return _read(path, fmt, capacity, convention, prices, step_seconds)
    except TraceFormatError:
        raise
    except UnicodeDecodeError as exc:  # a ValueError too: say what it is
        raise TraceFormatError(
            path, "", f"not UTF-8 text ({exc.reason} at byte {exc.start})",
            "give a CSV or JSON trace file",
        ) from None  # fmt: skip
    except (ValueError, OverflowError, TypeError) as exc:  # a value the Trace refuses
        if capacity is not None and "capacity=" in str(exc):  # the caller's, not the file's
            where = f"capacity={capacity}"
            raise TraceFormatError(path, where, str(exc), GIVEN_CAPACITY_FIX) from exc
        raise TraceFormatError(path, "", str(exc), "correct the file's times or values") from exc


def _read(
    path: Path,
    fmt: str,
    capacity: int | None,
    convention: Convention,
    prices: Path | dict[str, list[float]] | Literal["auto"] | None,
    step_seconds: float | None,
) -> Trace:
    if fmt == "skynomad-availability-csv":
        return read_availability_csv(path, prices)
    if fmt == "skynomad-json":
        return read_node_json(path, _read_json(path), capacity, convention)
    if fmt == "bamboo-events":
        return read_bamboo_events(path, step_seconds or 60.0, capacity)
    if fmt == "pccheck-gpus":
        return read_pccheck_gpus(path, capacity=capacity)
    if fmt == "pcframe-csv":
        return read_pcframe_csv(path, capacity)
    if fmt == "pcframe-json":
        return read_pcframe_json(path, _read_json(path), capacity)
    raise TraceFormatError(
        path, "", f"format={fmt!r} is unknown", f"use auto, {', '.join(FORMATS)}"
    )


def trace_files(root: str | Path) -> list[Path]:
    """Every trace file under ``root`` (recursively), sorted; licences and price tables skipped."""
    root = Path(root)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"trace directory {root} does not exist")
    return [p for p in sorted(root.rglob("*")) if is_trace_file(p)]


def is_trace_file(path: Path) -> bool:
    """A CSV or JSON file that is not a licence, notice, readme or price table."""
    stem = path.stem.lower()
    return (
        path.is_file()
        and path.suffix.lower() in (".csv", ".json")
        and stem not in _NOT_TRACES
        and "price" not in stem
    )


def load_traces(root: str | Path | None = None, **kwargs: Any) -> list[Trace]:
    """Load every trace under ``root`` (default: :func:`shared_traces_dir`)."""
    if root is None:
        root = shared_traces_dir()
        if root is None:
            raise FileNotFoundError(
                f"no traces found: set ${ENV_VAR} or copy them to experiments/traces"
            )
    return [load_trace(p, **kwargs) for p in trace_files(root)]
