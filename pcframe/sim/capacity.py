"""Spot capacity, prices and preemptions of one trace, as the simulator queries them.

How a trace maps to the job (documented in docs/simulator.md):

* **Availability traces** (capacity 1: SkyNomad V100 CSVs, GCP H100 zones): ``up = 1`` means
  spot VMs can be had. The job gets all the spot VMs it asks for while ``up = 1`` and loses
  all of them when it drops to 0 (one zone-wide event).
* **Count traces** (capacity > 1: SkyNomad 4-/16-node, Bamboo, PCcheck): ``up`` of the
  requested VMs are running. The job (data parallel) takes ``min(up, wanted)`` of them when it
  starts and keeps that set until its next restart; it takes newly arrived VMs only then.
  A drop of ``d`` VMs hits the job if any of its ``n`` VMs is among them; which ones drop is
  not in the trace, so it is drawn (hypergeometric, one seeded uniform per tick, the same
  draw for every policy). A data-parallel job restarts on any lost VM of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pcframe.errors import SimConfigError
from pcframe.policies.predictors.base import Prediction
from pcframe.policies.resource import ResourceContext, ResourceDecision
from pcframe.policies.traces import Trace
from pcframe.sim.spec import SimOptions


@dataclass(frozen=True)
class Window:
    """The part of the trace that is simulated, in trace seconds."""

    start: float
    end: float


class Capacity:
    """Queries on one trace: VMs available, preemptions that hit the job, cost of VMs."""

    def __init__(self, trace: Trace, options: SimOptions) -> None:
        self.trace = trace
        self.dt = float(trace.step_seconds)
        self.up = np.asarray(trace.up, dtype=np.int64)
        self.n_ticks = int(self.up.size)
        self.capacity = int(trace.capacity)
        # Availability traces lose every VM of the zone at once; count traces lose some.
        self.zonal = self.capacity == 1
        end = self.n_ticks * self.dt
        if options.start >= end:
            raise SimConfigError(
                f"sim.options.start={options.start} is at or after the end of trace "
                f"{_where(trace)} ({end:.0f} s); give a start inside the trace"
            )
        stop = end if options.duration is None else min(end, options.start + options.duration)
        self.window = Window(float(options.start), float(stop))
        self.spot_price = self._spot_prices(trace, options)
        self.on_demand_price = self._on_demand_price(trace, options)
        # Dollar-hours integral of one spot VM up to the start of each tick, for O(1) billing.
        self._spot_cum = np.concatenate(([0.0], np.cumsum(self.spot_price * self.dt / 3600.0)))
        self.changes = np.flatnonzero(self.up[1:] != self.up[:-1]) + 1
        self.change_times = self.changes * self.dt
        # One uniform per tick, drawn up front: the same preemption draws for every policy.
        self._u = np.random.default_rng(options.seed).random(self.n_ticks)

    # --- prices -----------------------------------------------------------------------------
    @staticmethod
    def _spot_prices(trace: Trace, options: SimOptions) -> np.ndarray:
        if trace.spot_price is not None and not options.override_prices:
            price = np.asarray(trace.spot_price, dtype=np.float64)
            bad = ~np.isfinite(price) | (price < 0)
            if bad.any():
                tick = int(np.flatnonzero(bad)[0])
                raise SimConfigError(
                    f"trace {_where(trace)}: spot price at tick {tick} is {float(price[tick])!r}; "
                    "prices must be finite $/h >= 0 (fix the file, or set "
                    "sim.options.override_prices=true and sim.options.spot_price: "
                    "SimOptions(override_prices=True, spot_price=...))"
                )
            return price
        value = math.nan if options.spot_price is None else float(options.spot_price)
        return np.full(trace.n_ticks, value)

    @staticmethod
    def _on_demand_price(trace: Trace, options: SimOptions) -> float:
        if trace.on_demand_price is not None and not options.override_prices:
            price = float(trace.on_demand_price)
            if not (math.isfinite(price) and price >= 0):
                raise SimConfigError(
                    f"trace {_where(trace)}: on-demand price {price!r} must be finite $/h >= 0"
                )
            return price
        return math.nan if options.on_demand_price is None else float(options.on_demand_price)

    def spot_cost(self, a: float, b: float, vms: int) -> float:
        """Dollars for ``vms`` spot VMs over trace seconds [a, b)."""
        if vms <= 0 or b <= a:
            return 0.0
        return vms * (self._cum(b) - self._cum(a))

    def on_demand_cost(self, a: float, b: float, vms: int) -> float:
        if vms <= 0 or b <= a:
            return 0.0
        return vms * self.on_demand_price * (b - a) / 3600.0

    def _cum(self, t: float) -> float:
        k = self.tick(t)
        return float(self._spot_cum[k] + self.spot_price[k] * (t - k * self.dt) / 3600.0)

    def spot_price_at(self, t: float) -> float:
        return float(self.spot_price[self.tick(t)])

    # --- capacity ---------------------------------------------------------------------------
    def tick(self, t: float) -> int:
        """Index of the tick covering trace second ``t`` (clamped to the trace).

        Event times are computed as ``k * dt``; with a fractional ``dt`` that product can
        fall a hair below the boundary (``(840 * 0.05) // 0.05 == 839``), so a relative
        tolerance of 1e-9 tick puts it on the tick it starts.
        """
        return min(max(int(t / self.dt + 1e-9), 0), self.n_ticks - 1)

    def spot_available(self, t: float, wanted: int) -> int:
        """Spot VMs the job would get if it (re)started at ``t`` asking for ``wanted``."""
        up = int(self.up[self.tick(t)])
        if self.zonal:
            return wanted if up > 0 else 0
        return min(up, wanted)

    def next_change(self, t: float) -> float:
        """Time of the first capacity change strictly after ``t`` (``inf`` if none)."""
        i = int(np.searchsorted(self.change_times, t, side="right"))
        return float(self.change_times[i]) if i < self.change_times.size else math.inf

    def hits(self, k: int, vms: int) -> bool:
        """Whether the drop at tick ``k`` takes at least one of the job's ``vms`` spot VMs."""
        if k <= 0 or vms <= 0:
            return False
        before, after = int(self.up[k - 1]), int(self.up[k])
        lost = before - after
        if lost <= 0:
            return False
        if self.zonal or vms >= before:
            return True
        # P(no VM of the job among the `lost`) for a uniformly random set of lost VMs.
        spared = 1.0
        for i in range(lost):
            spared *= max(before - vms - i, 0) / (before - i)
        return bool(self._u[k] >= spared)

    def next_kill(self, t: float, vms: int) -> float:
        """First time after ``t`` at which the job running ``vms`` spot VMs is preempted."""
        if vms <= 0:
            return math.inf
        i = int(np.searchsorted(self.change_times, t, side="right"))
        for k in self.changes[i:]:
            if self.hits(int(k), vms):
                return float(k * self.dt)
        return math.inf

    def resource_context(
        self,
        t: float,
        start: float,
        prediction: Prediction | None,
        current: ResourceDecision | None,
        *,
        work_done: float,
        changeover: float,
        work_total: float | None = None,
        deadline: float | None = None,
    ) -> ResourceContext:
        """What a resource policy is shown at trace second ``t`` of a job that started at
        ``start``: this trace's capacity and prices, the predictor's ``prediction``, the VMs
        it runs on (``current``). The simulator and the real-kills replay both ask this."""
        return ResourceContext(
            now=t - start,
            work_done=work_done,
            work_total=work_total,
            deadline=deadline,
            availability=None if prediction is None else prediction.availability,
            preemption_rate=None if prediction is None else prediction.rate,
            spot_available=self.spot_available(t, 1) > 0,
            spot_price=self.spot_price_at(t),
            on_demand_price=self.on_demand_price,
            current=current,
            changeover=changeover,
        )

    def capacity_fraction(self, k: int) -> float:
        return float(self.up[k]) / self.capacity


def _where(trace: Trace) -> str:
    return trace.path or trace.name
