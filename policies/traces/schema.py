"""One normalised schema for every spot trace, whatever file it came from."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_TAG = "pcframe-trace/1"
# Bounds that keep the simulator's clock exact: at 1e17 s a second is below float precision,
# and the loop would never advance.
MAX_STEP_SECONDS = 7 * 86400.0
MAX_DURATION = 100 * 365.25 * 86400.0


@dataclass(frozen=True)
class TraceStats:
    """Summary of one trace; times in seconds, availability in [0, 1]."""

    name: str
    source: str
    ticks: int
    step_seconds: float
    hours: float
    capacity: int
    availability: float
    any_up_fraction: float
    preemptions: int
    instances_lost: float
    mtbf: float
    instance_mtbf: float


@dataclass(frozen=True, eq=False)
class Trace:
    """Spot capacity over time, sampled every ``step_seconds``.

    Attributes:
        name: short identifier, e.g. ``us-east-1a_v100_1``.
        source: which data set / file format it came from, e.g. ``skynomad-gcp-h100``.
        step_seconds: seconds between two ticks (median spacing for jittery sources).
        capacity: VMs (or ``unit``\\ s) requested; ``up`` never exceeds it.
        up: how many were up at each tick, int64, always in the "1 = up" convention.
        spot_price: spot $/h per tick for one VM (``None`` if unknown).
        on_demand_price: on-demand $/h for one VM (``None`` if unknown).
        start_time: time of tick 0, timezone-aware UTC (``None`` if unknown).
        zone: cloud zone, if known.
        unit: what ``up`` counts (``vm`` or ``gpu``); ``units_per_vm`` converts.
        metadata: anything else the file said (JSON-able).
    """

    name: str
    source: str
    step_seconds: float
    capacity: int
    up: np.ndarray
    spot_price: np.ndarray | None = None
    on_demand_price: float | None = None
    start_time: datetime | None = None
    zone: str | None = None
    unit: str = "vm"
    units_per_vm: int = 1
    path: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        up = np.asarray(self.up)
        if up.ndim != 1 or up.size == 0:
            raise ValueError(f"trace {self.name!r}: up must be a non-empty 1-D array")
        if not (0 < self.step_seconds <= MAX_STEP_SECONDS):
            raise ValueError(
                f"trace {self.name!r}: step_seconds={self.step_seconds} must be in "
                f"(0, {MAX_STEP_SECONDS}] (a week)"
            )
        if up.size * self.step_seconds > MAX_DURATION:
            raise ValueError(
                f"trace {self.name!r}: {up.size} ticks of {self.step_seconds:g} s cover more than "
                f"{MAX_DURATION:.0f} s (100 years): check the time unit"
            )
        if self.on_demand_price is not None:
            price = self.on_demand_price
            if isinstance(price, bool) or not isinstance(price, int | float):
                raise ValueError(f"trace {self.name!r}: on_demand_price={price!r} is not a number")
            if not (math.isfinite(price) and price >= 0):
                raise ValueError(f"trace {self.name!r}: on_demand_price={price} must be >= 0")
            object.__setattr__(self, "on_demand_price", float(price))
        if self.capacity < 1:
            raise ValueError(f"trace {self.name!r}: capacity={self.capacity} must be >= 1")
        per_vm = self.units_per_vm
        if isinstance(per_vm, bool) or not isinstance(per_vm, int) or per_vm < 1:
            raise ValueError(
                f"trace {self.name!r}: units_per_vm={per_vm!r} must be a whole number >= 1 "
                "(the GPUs of one VM)"
            )
        if up.min() < 0 or up.max() > self.capacity:
            raise ValueError(
                f"trace {self.name!r}: up-counts must lie in [0, capacity={self.capacity}], "
                f"found [{up.min()}, {up.max()}]"
            )
        up = up.astype(np.int64, copy=True)
        up.setflags(write=False)  # frozen dataclass: keep the array immutable too
        object.__setattr__(self, "up", up)
        if self.spot_price is not None:
            price = np.asarray(self.spot_price, dtype=np.float64).copy()
            if price.shape != up.shape:
                raise ValueError(
                    f"trace {self.name!r}: {price.size} spot prices for {up.size} ticks"
                )
            price.setflags(write=False)
            object.__setattr__(self, "spot_price", price)

    # --- shape --------------------------------------------------------------------------------
    @property
    def n_ticks(self) -> int:
        return int(self.up.size)

    @property
    def duration(self) -> float:
        """Seconds covered by the trace."""
        return self.n_ticks * self.step_seconds

    def times(self) -> np.ndarray:
        """Seconds since tick 0 for every tick."""
        return np.arange(self.n_ticks) * self.step_seconds

    def unix_times(self) -> np.ndarray:
        if self.start_time is None:
            raise ValueError(f"trace {self.name!r} has no start_time")
        return self.start_time.timestamp() + self.times()

    # --- preemptions --------------------------------------------------------------------------
    def drops(self) -> np.ndarray:
        """How many units went down at each tick (0 where the count held or rose)."""
        d = np.zeros(self.n_ticks, dtype=np.int64)
        d[1:] = np.maximum(self.up[:-1] - self.up[1:], 0)
        return d

    def preemption_ticks(self) -> np.ndarray:
        """Ticks at which at least one unit was preempted (the up-count dropped)."""
        return np.flatnonzero(self.drops() > 0)

    def preempted_at(self, tick: int) -> bool:
        """Whether a preemption happened at ``tick``."""
        if not 0 <= tick < self.n_ticks:
            raise IndexError(f"tick {tick} outside trace {self.name!r} of {self.n_ticks} ticks")
        return bool(tick > 0 and self.up[tick] < self.up[tick - 1])

    def preemption_count(self) -> int:
        """Number of up→down drops (one per tick at which the count fell)."""
        return int(self.preemption_ticks().size)

    def instances_lost(self) -> float:
        """VMs lost over the trace: summed drops converted from ``unit`` to VMs."""
        return float(self.drops().sum()) / self.units_per_vm

    # --- availability -------------------------------------------------------------------------
    def availability(self) -> float:
        """Mean fraction of requested capacity that was up."""
        return float(self.up.mean() / self.capacity)

    def any_up_fraction(self) -> float:
        """Fraction of ticks with at least one unit up."""
        return float((self.up > 0).mean())

    def up_seconds(self) -> float:
        """Seconds during which at least one unit was up."""
        return float((self.up > 0).sum() * self.step_seconds)

    def mtbf(self) -> float:
        """Mean time between preemptions = up-time / number of up→down drops (``inf`` if none)."""
        n = self.preemption_count()
        return math.inf if n == 0 else self.up_seconds() / n

    def instance_mtbf(self) -> float:
        """Per-VM mean lifetime: VM-seconds up / VMs lost (``inf`` if none were lost)."""
        lost = self.instances_lost()
        vm_seconds = float(self.up.sum()) * self.step_seconds / self.units_per_vm
        return math.inf if lost == 0 else vm_seconds / lost

    def stats(self) -> TraceStats:
        return TraceStats(
            name=self.name,
            source=self.source,
            ticks=self.n_ticks,
            step_seconds=self.step_seconds,
            hours=self.duration / 3600.0,
            capacity=self.capacity,
            availability=self.availability(),
            any_up_fraction=self.any_up_fraction(),
            preemptions=self.preemption_count(),
            instances_lost=self.instances_lost(),
            mtbf=self.mtbf(),
            instance_mtbf=self.instance_mtbf(),
        )

    # --- the documented pcframe JSON form ----------------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_TAG,
            "name": self.name,
            "source": self.source,
            "step_seconds": self.step_seconds,
            "capacity": self.capacity,
            "up": self.up.tolist(),
            "spot_price": None if self.spot_price is None else self.spot_price.tolist(),
            "on_demand_price": self.on_demand_price,
            "start_time": None if self.start_time is None else self.start_time.isoformat(),
            "zone": self.zone,
            "unit": self.unit,
            "units_per_vm": self.units_per_vm,
            "metadata": self.metadata,
        }

    def save_json(self, path: str | Path) -> Path:
        """Write the trace in the pcframe JSON form that :func:`load_trace` reads back."""
        path = Path(path)
        path.write_text(json.dumps(self.to_json_dict()))
        return path
