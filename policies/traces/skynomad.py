"""Readers for the SkyNomad artifact's traces (AWS V100 2023, GCP H100 2025).

Three shapes: availability CSVs ``date,availability`` with a sibling price table
``{trace_name: [$/h per tick]}``; node-count JSON ``{"metadata": {...}, "data": [...]}``
(4 or 16 kept-alive VMs); and the GCP H100 JSON of the same shape whose values are
*inverted*: 1 = preempted / unavailable, 0 = available.
"""

from __future__ import annotations

import csv
import json
import logging
import re
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pcframe.policies.errors import TraceFormatError
from pcframe.policies.traces.schema import Trace
from pcframe.policies.traces.timeutil import median_step, parse_time

# p3.2xlarge (1×V100) on-demand price in us-east/us-west, as given by the traces' README.
AWS_P3_2XLARGE_ON_DEMAND = 3.06

log = logging.getLogger("pcframe")
_WARNED: set[tuple[str, str]] = set()  # (guess, file) said already: sweeps load files again


def _warn_once(guess: str, message: str, path: Path, *args: Any) -> None:
    """Say at WARNING how a file was read where it did not say, once per file and guess."""
    if (guess, str(path)) not in _WARNED:
        _WARNED.add((guess, str(path)))
        log.warning(message, path, *args)


Convention = Literal["auto", "up", "inverted"]


def _zone(stem: str) -> str:
    return stem.split("_", 1)[0]


def find_price_table(path: Path) -> Path | None:
    """The ``*price*.json`` beside the CSV (or in its parent folder) that holds a series for
    this trace (its name as a key), else the first one found (no prices for this trace)."""
    found = [
        c
        for folder in (path.parent, path.parent.parent)
        for c in sorted(folder.glob("*price*.json"))
        # a regular file only: reading a FIFO of that name blocked for ever, and a folder
        # or a broken link was a raw traceback
        if c.is_file()
    ]
    key = f'"{path.stem}"'.encode()
    for candidate in found:
        try:
            if key in candidate.read_bytes():
                return candidate
        except OSError:
            continue
    return found[0] if found else None


def _prices(path: Path, table: Path | dict[str, list[float]] | None, n: int) -> np.ndarray | None:
    if table is None:
        return None
    where = "price table"
    if isinstance(table, Path):
        where = str(table)
        try:
            table = json.loads(table.read_text(encoding="utf-8-sig"))
        except OSError as exc:  # unreadable (no permission, removed since it was found)
            raise TraceFormatError(
                table, "", f"cannot read the price table of {path.name} ({exc.strerror or exc})",
                "make it readable, or move it away to simulate without spot prices",
            ) from None  # fmt: skip
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # the table's, not the CSV's
            at = f"line {exc.lineno} column {exc.colno}" if hasattr(exc, "lineno") else ""
            raise TraceFormatError(
                table, at, f"the price table of {path.name} is not JSON: {exc}",
                "repair it, or move it away to simulate without spot prices",
            ) from None  # fmt: skip
    if not isinstance(table, dict):
        raise TraceFormatError(
            path, where, "the price table is not a JSON object",
            '{"<trace name>": [<$/h per tick>, ...], ...}',
        )  # fmt: skip
    series = table.get(path.stem)
    if series is None:
        return None
    if not isinstance(series, list) or len(series) != n:
        count = len(series) if isinstance(series, list) else "no list of"
        raise TraceFormatError(
            path,
            f"key {path.stem!r} of {where}",
            f"{count} prices for {n} availability rows",
            "use the price table that belongs to this trace (one price per tick)",
        )
    for i, price in enumerate(series):  # null, "1.2", -5: refused here, not at simulate()
        if isinstance(price, bool) or not isinstance(price, int | float) or not 0 <= price < 1e9:
            raise TraceFormatError(
                path,
                f"key {path.stem!r}[{i}] of {where}",
                f"price {price!r} is not a number of $/h >= 0",
                "write one price per tick in $/h",
            )
    return np.asarray(series, dtype=np.float64)


def read_availability_csv(
    path: Path, prices: Path | dict[str, list[float]] | Literal["auto"] | None = "auto"
) -> Trace:
    """``date,availability`` rows, 1 = a spot VM could be launched at that tick."""
    times: list[float] = []
    up: list[int] = []
    lines: list[int] = []
    start = None
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [c.strip() for c in header] != ["date", "availability"]:
            raise TraceFormatError(
                path,
                "line 1",
                f"header {header} is not 'date,availability'",
                "use the SkyNomad availability CSV layout or the pcframe CSV form",
            )
        for lineno, row in enumerate(reader, start=2):
            if not "".join(row).strip():  # a blank or whitespace-only line (an editor's end)
                continue
            if len(row) != 2 or row[1].strip() not in ("0", "1"):
                raise TraceFormatError(
                    path,
                    f"line {lineno}",
                    f"expected 'date,0|1', got {','.join(row)!r}",
                    "availability must be 0 or 1",
                )
            stamp = parse_time(row[0], path, f"line {lineno}")
            start = start or stamp
            times.append(stamp.timestamp())
            up.append(int(row[1]))
            lines.append(lineno)
    step = median_step(np.asarray(times), path, lines)
    table = find_price_table(path) if prices == "auto" else prices
    return Trace(
        name=path.stem,
        source="skynomad-aws-v100-availability",
        step_seconds=step,
        capacity=1,
        up=np.asarray(up, dtype=np.int64),
        spot_price=_prices(path, table, len(up)),
        on_demand_price=AWS_P3_2XLARGE_ON_DEMAND if "v100" in path.stem else None,
        start_time=start,
        zone=_zone(path.stem),
        path=str(path),
        metadata={"instance": "p3.2xlarge"} if "v100" in path.stem else {},
    )


def is_inverted(path: Path, meta: dict[str, Any], values: np.ndarray) -> bool:
    """The GCP H100 collector writes 1 = preempted. Its files carry ``price_info`` and
    ``gap_filled`` and name their ``source_dir`` (``.../gcp_h100_16nodes/...``): either of
    the last two marks the file (one whose price fetch failed, without ``price_info``, is not
    read with its availability upside down), and ``price_info`` does where the values are
    0/1 (other collectors give prices too: a GCP fleet of 8 VMs counts VMs up).

    Not the file's name: a user's own up-count file named ``my_h100_up.json`` read inverted.
    """
    source = str(meta.get("source_dir", "")).lower()
    if "gap_filled" in meta or "gcp_h100" in source:
        return True
    return "price_info" in meta and values.max() <= 1


def read_node_json(
    path: Path,
    doc: dict[str, Any],
    capacity: int | None = None,
    convention: Convention = "auto",
) -> Trace:
    """``{"metadata": {"gap_seconds": ...}, "data": [...]}`` node-count or H100 traces."""
    meta = doc.get("metadata")
    gap = meta.get("gap_seconds") if isinstance(meta, dict) else None
    if isinstance(gap, bool) or not isinstance(gap, int | float) or not 0 < gap < 1e9:
        missing = not isinstance(meta, dict) or "gap_seconds" not in meta
        raise TraceFormatError(
            path,
            "key 'metadata.gap_seconds'",
            "missing the tick length" if missing else f"{gap!r} is not a number of seconds > 0",
            'add "metadata": {"gap_seconds": <seconds per tick>}',
        )
    data = doc.get("data")
    if not isinstance(data, list) or not data:
        raise TraceFormatError(
            path,
            "key 'data'",
            "'data' must be a non-empty list of counts",
            "write one integer per tick under 'data'",
        )
    for i, x in enumerate(data):
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise TraceFormatError(
                path,
                f"key 'data[{i}]'",
                f"value {x!r} is not a non-negative integer",
                "write one integer count per tick",
            )
    values = np.asarray(data, dtype=np.int64)
    price_info = meta.get("price_info") or {}
    if not isinstance(price_info, dict):
        raise TraceFormatError(
            path,
            "key 'metadata.price_info'",
            f"{type(price_info).__name__} where an object is expected",
            'write "price_info": {"price": <$/h>, "machine_type": ...} or leave it out',
        )
    if convention == "auto":
        # 1 = preempted is a 0/1 series: a GCP fleet of 8 VMs with prices was refused as
        # "inverted", where it counts VMs up.
        inverted = is_inverted(path, meta, values)
        if values.max() <= 1 and not inverted:
            _warn_once(
                "convention",
                "%s: 0/1 values and no mark of the GCP H100 collector (price_info, "
                "gap_filled, source_dir): read as 1 = up; if 1 means preempted, load it with "
                "convention='inverted' (pcframe-sim: trace_options.convention=inverted)",
                path,
            )
    else:
        inverted = convention == "inverted"
    if inverted:
        if values.max() > 1:
            raise TraceFormatError(
                path,
                "key 'data'",
                f"inverted (1 = preempted) trace holds {values.max()}",
                "load it with convention='up' if this file counts VMs that are up "
                "(pcframe-sim: trace_options.convention=up)",
            )
        up, cap, source = 1 - values, 1, "skynomad-gcp-h100"
    else:
        cap = capacity or _capacity_of(path, meta, values)
        if values.max() > cap:
            raise TraceFormatError(
                path,
                "key 'data'",
                f"count {values.max()} exceeds capacity {cap}",
                "load it with capacity=<VMs requested> (pcframe-sim: trace_options.capacity=N)",
            )
        kind = "aws-v100" if "v100" in path.stem else "count"
        up, source = values, f"skynomad-{kind}-{cap}node"
    spot = price_info.get("price")
    start = meta.get("start_time")
    extra = {k: v for k, v in meta.items() if k not in ("price_info",)}
    if price_info:
        extra["machine_type"] = price_info.get("machine_type")
    return Trace(
        name=path.stem,
        source=source,
        step_seconds=float(meta["gap_seconds"]),
        capacity=cap,
        up=up,
        spot_price=None if spot is None else np.full(up.size, float(spot)),
        on_demand_price=price_info.get("on_demand_price")
        or (AWS_P3_2XLARGE_ON_DEMAND if "v100" in path.stem else None),
        start_time=None if start is None else parse_time(start, path, "key 'start_time'"),
        zone=meta.get("zone") or _zone(path.stem),
        path=str(path),
        metadata=extra,
    )


def _capacity_of(path: Path, meta: dict[str, Any], values: np.ndarray) -> int:
    """VMs asked for: the file's ``metadata.capacity``, else its folder's name (``16node``),
    else the most ever up, said at WARNING: a job of 4 VMs never all up at once would read
    as 3 (its availability overstated, its goodput ratio against the wrong ideal)."""
    given = meta.get("capacity")
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given < 1:
            raise TraceFormatError(
                path,
                "key 'metadata.capacity'",
                f"{given!r} is not a whole number of VMs >= 1",
                'write "capacity": <VMs requested> or leave it out',
            )
        return given
    named = _capacity_from_name(path)
    if named:
        return named
    most = max(int(values.max()), 1)
    _warn_once(
        "capacity",
        "%s: no capacity given (metadata.capacity, or a folder named like '4node'): "
        "taken as the most VMs ever up, %d; load it with capacity=N "
        "(pcframe-sim: trace_options.capacity=N) if the job asked for more",
        path,
        most,
    )
    return most


def _capacity_from_name(path: Path) -> int | None:
    """``aws-v100-16node-2023`` / ``...-4node-...``: the folder says how many VMs were asked for."""
    for part in (path.parent.name, path.stem):
        m = re.search(r"(\d+)node", part)
        if m:
            return int(m.group(1))
    return None
