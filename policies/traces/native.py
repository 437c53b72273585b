"""pcframe's own documented trace forms, for users' traces (see docs/policies.md).

JSON: ``{"format": "pcframe-trace/1", "step_seconds": 300, "capacity": 4, "up": [...], ...}``
with optional ``name``, ``source``, ``spot_price`` (list, one per tick), ``on_demand_price``,
``start_time`` (ISO 8601), ``zone``, ``unit``, ``units_per_vm``, ``metadata``.

CSV: optional ``# key: value`` lines (``capacity``, ``on_demand_price``, ``zone``, ``name``,
``unit``, ``units_per_vm``, ``source``), then a header ``time,up`` with an optional
``spot_price`` column. ``time`` is seconds (any origin) or an ISO 8601 timestamp; rows must
be evenly spaced (the median spacing is used) and strictly increasing.
"""

from __future__ import annotations

import csv
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from pcframe.policies.errors import TraceFormatError
from pcframe.policies.traces.schema import FORMAT_TAG, Trace
from pcframe.policies.traces.timeutil import median_step, parse_time

_META_KEYS = {"capacity", "on_demand_price", "zone", "name", "unit", "units_per_vm", "source"}


# Times in this range are 1973-5138 in milliseconds since the epoch, and past the year 5000
# in seconds: such a file counts milliseconds.
EPOCH_MILLISECONDS = (1e11, 1e14)


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _whole(x: object) -> bool:
    """An integer (not a bool, not 2.7: JSON counts were truncated by int())."""
    return isinstance(x, int) and not isinstance(x, bool)


GIVEN_CAPACITY_FIX = (
    "give a capacity of at least the most ever up (the VMs, or GPUs, the job asked for; "
    "pcframe-sim: trace_options.capacity), or leave it out to use the file's"
)


def _given_capacity_fits(path: Path, up: list[int], capacity: int) -> None:
    """A ``capacity=`` given to the loader (over what the file says) holds every up-count."""
    if up and max(up) > capacity:
        raise TraceFormatError(
            path,
            f"capacity={capacity}",
            f"the capacity given is below the file's up-count {max(up)}",
            GIVEN_CAPACITY_FIX,
        )


def read_pcframe_json(
    path: Path, doc: dict[str, Any] | None = None, capacity: int | None = None
) -> Trace:
    """``capacity``: VMs requested, over the file's ``capacity`` (checked all the same)."""
    if doc is None:
        doc = json.loads(path.read_text(encoding="utf-8-sig"))
    for key in ("step_seconds", "capacity", "up"):
        if key not in doc:
            raise TraceFormatError(
                path,
                f"key {key!r}",
                f"missing required key {key!r}",
                f"add {key!r} (see the pcframe-trace/1 form in docs/policies.md)",
            )
    up = doc["up"]
    if not isinstance(up, list) or not all(_whole(x) and x >= 0 for x in up):
        raise TraceFormatError(
            path,
            "key 'up'",
            "'up' must be a list of non-negative integers",
            "write one integer up-count per tick",
        )
    if isinstance(doc["step_seconds"], bool) or not _number(doc["step_seconds"]):
        raise TraceFormatError(
            path, "key 'step_seconds'", f"{doc['step_seconds']!r} is not a number of seconds",
            "give the seconds per tick, e.g. 300",
        )  # fmt: skip
    if not isinstance(doc.get("metadata") or {}, dict):
        raise TraceFormatError(
            path, "key 'metadata'", f"{type(doc['metadata']).__name__} where an object is "
            "expected", 'write "metadata": {...} or leave it out',
        )  # fmt: skip
    for key in ("capacity", "units_per_vm"):
        if key in doc and not _whole(doc[key]):
            raise TraceFormatError(
                path, f"key {key!r}", f"{doc[key]!r} is not a whole number", f"give {key!r} as one"
            )
    prices = doc.get("spot_price")
    if prices is not None and not (
        isinstance(prices, list) and all(_number(x) and math.isfinite(x) and x >= 0 for x in prices)
    ):
        raise TraceFormatError(
            path, "key 'spot_price'", "spot prices must be finite numbers >= 0 ($/h)",
            "correct them, or drop 'spot_price' and give the simulator a price",
        )  # fmt: skip
    if capacity is not None:
        _given_capacity_fits(path, up, capacity)
    start = doc.get("start_time")
    try:
        trace = Trace(
            name=str(doc.get("name") or path.stem),
            source=str(doc.get("source") or "pcframe-json"),
            step_seconds=float(doc["step_seconds"]),
            capacity=int(doc["capacity"] if capacity is None else capacity),
            up=np.asarray(up, dtype=np.int64),
            spot_price=None if doc.get("spot_price") is None else np.asarray(doc["spot_price"]),
            on_demand_price=doc.get("on_demand_price"),
            start_time=None if start is None else parse_time(start, path, "key 'start_time'"),
            zone=doc.get("zone"),
            unit=str(doc.get("unit", "vm")),
            units_per_vm=int(doc.get("units_per_vm", 1)),
            path=str(path),
            metadata=dict(doc.get("metadata") or {}),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, TraceFormatError):
            raise
        raise TraceFormatError(path, "", str(exc), "correct the value named above") from exc
    return trace


def _header_number(
    path: Path, meta: dict[str, str], key: str, kind: type, default: Any = None
) -> Any:
    """A ``# key: value`` line's number (``int`` or ``float``), named where it is not one."""
    if key not in meta:
        return default
    try:
        value = kind(meta[key])
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise TraceFormatError(
            path, f"# {key}", f"{meta[key]!r} is not {what}", f"write '# {key}: <{what}>'"
        ) from None
    if not (value >= 0 and math.isfinite(value)):
        raise TraceFormatError(path, f"# {key}", f"{value} is below 0", f"give '# {key}' >= 0")
    return value


def read_pcframe_csv(path: Path, capacity: int | None = None) -> Trace:
    """``capacity``: VMs requested, over the file's ``# capacity:`` (checked all the same)."""
    meta: dict[str, str] = {}
    rows: list[tuple[int, list[str]]] = []
    header: list[str] | None = None
    with path.open(newline="", encoding="utf-8-sig") as f:
        for lineno, row in enumerate(csv.reader(f), start=1):
            if not row or not "".join(row).strip():
                continue
            if row[0].lstrip().startswith("#"):
                key, sep, value = ",".join(row).lstrip("# ").partition(":")
                if sep and key.strip() in _META_KEYS:
                    meta[key.strip()] = value.strip()
                continue
            if header is None:
                header = [c.strip().lower() for c in row]
                continue
            rows.append((lineno, row))
    if header is None or header[:2] != ["time", "up"]:
        raise TraceFormatError(
            path,
            "line 1",
            f"header {header} is not 'time,up[,spot_price]'",
            "start the file with the header line 'time,up' (optionally ',spot_price')",
        )
    if not rows:
        raise TraceFormatError(path, "", "no data rows", "add at least one 'time,up' row")
    has_price = "spot_price" in header
    price_col = header.index("spot_price") if has_price else -1
    times: list[float] = []
    up: list[int] = []
    price: list[float] = []
    start: datetime | None = None
    for lineno, row in rows:
        if len(row) < len(header):
            raise TraceFormatError(
                path,
                f"line {lineno}",
                f"{len(row)} columns, header has {len(header)}",
                "give every row the same columns as the header",
            )
        t = row[0].strip()
        try:
            times.append(float(t))
        except ValueError:
            stamp = parse_time(t, path, f"line {lineno}")
            start = start or stamp
            times.append(stamp.timestamp())
        try:
            up.append(int(row[1]))
            if has_price:
                price.append(float(row[price_col]))
        except ValueError as exc:
            raise TraceFormatError(
                path,
                f"line {lineno}",
                f"not a number: {exc}",
                "write 'up' as an integer and 'spot_price' as a number ($/h)",
            ) from exc
        if up[-1] < 0:
            raise TraceFormatError(
                path, f"line {lineno}", f"negative up-count {up[-1]}", "use counts >= 0"
            )
        if has_price and not (math.isfinite(price[-1]) and price[-1] >= 0):
            raise TraceFormatError(
                path, f"line {lineno}", f"spot price {price[-1]} is not a finite $/h >= 0",
                "correct it, or drop the spot_price column and give the simulator a price",
            )  # fmt: skip
    finite = [t for t in times if math.isfinite(t)]  # others: median_step names them
    low, high = EPOCH_MILLISECONDS
    if start is None and finite and low < max(finite) < high:
        raise TraceFormatError(
            path, f"line {rows[times.index(max(finite))][0]}",
            f"time {max(finite):.0f} is past the year 5000 in seconds: milliseconds since the "
            "epoch?", "write times in seconds (divide by 1000)",
        )  # fmt: skip
    step = median_step(np.asarray(times), path, lines=[ln for ln, _ in rows])
    stated = _header_number(path, meta, "capacity", int, max(max(up), 1))
    if capacity is not None:
        _given_capacity_fits(path, up, capacity)
    elif max(up) > stated:
        raise TraceFormatError(
            path,
            "# capacity",
            f"up-count {max(up)} exceeds capacity {stated}",
            "raise '# capacity:' or correct the counts",
        )
    capacity = stated if capacity is None else capacity
    od = meta.get("on_demand_price")
    return Trace(
        name=meta.get("name", path.stem),
        source=meta.get("source", "pcframe-csv"),
        step_seconds=step,
        capacity=capacity,
        up=np.asarray(up, dtype=np.int64),
        spot_price=np.asarray(price) if has_price else None,
        on_demand_price=None
        if od is None
        else _header_number(path, meta, "on_demand_price", float),
        start_time=start,
        zone=meta.get("zone"),
        unit=meta.get("unit", "vm"),
        units_per_vm=_header_number(path, meta, "units_per_vm", int, 1),
        path=str(path),
        metadata={"format": FORMAT_TAG + "+csv"},
    )
