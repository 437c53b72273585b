"""Resource policies (for the simulator): spot or on-demand, and how many spot VMs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pcframe.errors import PolicyError
from pcframe.policies.base import REASON_FIX, Event, Stateful, reason_problem
from pcframe.policies.kinds import plugin_base
from pcframe.policies.predictors.base import Estimate
from pcframe.runtime.checks import whole_number


def checked_vms(key: str, vms: Any) -> int:
    """``vms``, a resource policy's VM count: a whole number >= 1 (NaN and 1.5 passed
    ``< 1``, and failed at the first decision naming no key)."""
    if not whole_number(vms) or vms < 1:
        raise ValueError(f"{key}={vms!r} must be a whole number of VMs >= 1")
    return int(vms)


@dataclass(frozen=True)
class ResourceDecision:
    """VMs to run now. Both zero means: wait (no VM, no cost, no progress)."""

    spot: int = 0
    on_demand: int = 0
    reason: str = ""

    def __post_init__(self) -> None:
        counts = (self.spot, self.on_demand)
        # A whole number of VMs: NaN passed `< 0` (the simulator then ran nothing and said
        # goodput 0), 1.5 ran and billed one and a half VMs, "1" was a TypeError deep in it.
        if any(not whole_number(n) or n < 0 for n in counts):
            raise ValueError(
                f"VM counts must be whole numbers >= 0, got spot={self.spot!r}, "
                f"on_demand={self.on_demand!r}"
            )
        object.__setattr__(self, "spot", int(self.spot))
        object.__setattr__(self, "on_demand", int(self.on_demand))

    @property
    def mode(self) -> str:
        """``spot``, ``on_demand``, ``mixed`` or ``idle``."""
        if self.spot and self.on_demand:
            return "mixed"
        return "spot" if self.spot else "on_demand" if self.on_demand else "idle"


def checked_resource_decision(policy: Any, decision: Any) -> ResourceDecision:
    """``decision`` if it is a :class:`ResourceDecision` with a ``str`` reason; else a
    :class:`PolicyError` naming the policy's class and what is wrong, on one line."""
    who = f"{type(policy).__module__}.{type(policy).__qualname__}"
    if not isinstance(decision, ResourceDecision):  # was a bare AssertionError, or worse
        raise PolicyError(
            f"policy {who}.decide returned {decision!r:.80}; it must return "
            "pcframe.policies.ResourceDecision(spot=..., on_demand=..., reason=...)"
        )
    problem = reason_problem(decision.reason)
    if problem is not None:
        raise PolicyError(
            f"policy {who}.decide returned a ResourceDecision with {problem}. Fix: {REASON_FIX}"
        )
    return decision


@dataclass(frozen=True)
class ResourceContext:
    """The simulator's view at one decision point. Times in seconds since the job started.

    Attributes:
        work_total: seconds of compute the job needs on one VM (``None``: open-ended).
        work_done: seconds of compute completed and checkpointed.
        deadline: seconds after start by which the job must finish (``None``: none).
        availability: predicted fraction of requested spot capacity that will be up.
        preemption_rate: predicted spot preemptions per second.
        spot_available: whether spot capacity can be had right now (from the trace).
        spot_price, on_demand_price: $/h per VM.
        current: what is running now (``None`` at the start).
        changeover: seconds lost when switching between spot and on-demand (restart cost).
    """

    now: float
    work_done: float = 0.0
    work_total: float | None = None
    deadline: float | None = None
    availability: Estimate | None = None
    preemption_rate: Estimate | None = None
    spot_available: bool | None = None
    spot_price: float | None = None
    on_demand_price: float | None = None
    current: ResourceDecision | None = None
    changeover: float = 0.0

    @property
    def work_left(self) -> float | None:
        return None if self.work_total is None else max(self.work_total - self.work_done, 0.0)


@plugin_base("resource")
class ResourcePolicy(Stateful, ABC):
    """Decides which VMs the job runs on at each decision point."""

    name: ClassVar[str] = ""

    @abstractmethod
    def decide(self, ctx: ResourceContext) -> ResourceDecision:
        """The VMs to run until the next decision point."""

    def observe(self, event: Event) -> None:
        """Learn from what happened."""
