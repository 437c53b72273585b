"""What one simulation returns: goodput, where the time went, what it cost."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

BREAKDOWN = ("useful", "lost", "stall", "restart", "waiting")


@dataclass(frozen=True)
class SimResult:
    """Outcome of one job over one trace under one interval and one resource policy.

    Times are seconds of the job's wall clock. ``time`` splits ``wall_seconds`` exactly into
    ``useful`` (steps that survived), ``lost`` (work rolled back by preemptions, and a step
    cut short), ``stall`` (training blocked by checkpoints), ``restart`` (VMs booting and
    restoring, changeovers included) and ``waiting`` (no VM to run on).
    """

    trace: str
    source: str
    label: str
    interval_policy: str
    resource_policy: str
    wall_seconds: float
    useful_steps: int
    lost_steps: int
    time: dict[str, float]
    spot_cost: float
    on_demand_cost: float
    spot_vm_seconds: float
    on_demand_vm_seconds: float
    preemptions: int
    starts: int
    changeovers: int
    saves: int
    saves_lost: int
    emergency_saves: int
    decisions: int
    fast_forwards: int
    rollbacks: int
    finished: bool
    finish_seconds: float | None
    deadline_met: bool | None
    iteration_time: float
    ideal_goodput: float
    sim_seconds: float = 0.0
    params: dict[str, Any] = field(default_factory=dict)
    # With a placement policy (else empty, and absent from row()): its name, and the
    # restores per tier they read from.
    placement_policy: str = ""
    restores: dict[str, int] = field(default_factory=dict)
    # The step of every save started, in order; only with SimOptions(record_saves=True).
    save_steps: tuple[int, ...] = field(default=(), repr=False)

    @property
    def cost(self) -> float:
        return self.spot_cost + self.on_demand_cost

    @property
    def goodput(self) -> float:
        """Useful steps per wall second."""
        return self.useful_steps / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def steps_per_dollar(self) -> float:
        return self.useful_steps / self.cost if self.cost > 0 else math.nan

    @property
    def dollars_per_kstep(self) -> float:
        """Cost per 1000 useful steps."""
        return 1000.0 * self.cost / self.useful_steps if self.useful_steps else math.nan

    @property
    def goodput_ratio(self) -> float:
        """Goodput as a fraction of the ideal: the job's requested VMs (``job.vms``), always
        up, never checkpointing, never restarting. A resource policy that runs more VMs than
        requested can exceed 1."""
        return self.goodput / self.ideal_goodput if self.ideal_goodput > 0 else 0.0

    @property
    def efficiency(self) -> float:
        """Useful time as a fraction of wall time."""
        return self.time["useful"] / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def row(self) -> dict[str, Any]:
        """One flat CSV row: identity, parameters (``p_*``), metrics."""
        out: dict[str, Any] = {
            "trace": self.trace,
            "source": self.source,
            "label": self.label,
            "interval_policy": self.interval_policy,
            "resource_policy": self.resource_policy,
        }
        out.update({f"p_{k}": v for k, v in self.params.items()})
        out.update(
            wall_hours=self.wall_seconds / 3600.0,
            useful_steps=self.useful_steps,
            lost_steps=self.lost_steps,
            goodput=self.goodput,
            goodput_ratio=self.goodput_ratio,
            efficiency=self.efficiency,
            **{f"{k}_hours": v / 3600.0 for k, v in self.time.items()},
            cost=self.cost,
            spot_cost=self.spot_cost,
            on_demand_cost=self.on_demand_cost,
            steps_per_dollar=self.steps_per_dollar,
            dollars_per_kstep=self.dollars_per_kstep,
            spot_vm_hours=self.spot_vm_seconds / 3600.0,
            on_demand_vm_hours=self.on_demand_vm_seconds / 3600.0,
            preemptions=self.preemptions,
            starts=self.starts,
            changeovers=self.changeovers,
            saves=self.saves,
            saves_lost=self.saves_lost,
            emergency_saves=self.emergency_saves,
            finished=self.finished,
            finish_hours=None if self.finish_seconds is None else self.finish_seconds / 3600.0,
            deadline_met=self.deadline_met,
            sim_seconds=self.sim_seconds,
        )
        if self.placement_policy:  # only then: rows without placements keep their columns
            out["placement_policy"] = self.placement_policy
            out.update({f"restores_{tier}": n for tier, n in sorted(self.restores.items())})
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
