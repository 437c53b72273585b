"""Can't Be Late (NSDI '24) Uniform Progress: spot by default, on-demand only when behind.

The target is linear progress: by time t, ``work_total · t / deadline`` should be done. With
spot available the job runs on spot; without, it waits while ahead of the line and switches
to on-demand when behind. Leaving on-demand needs a lead of 2·changeover (else the next
outage flips it straight back), and a safety net pins on-demand once the slack left before
the deadline cannot absorb another changeover.
"""

from __future__ import annotations

from typing import Any

from pcframe.policies.registry import register
from pcframe.policies.resource.base import (
    ResourceContext,
    ResourceDecision,
    ResourcePolicy,
    checked_vms,
)


@register()
class UniformProgress(ResourcePolicy):
    """Uniform Progress with hysteresis and a deadline safety net.

    Args:
        vms: VMs of either kind.
        changeover: seconds lost per switch; ``ctx.changeover`` wins when it is > 0.
        safety_factor: the safety net fires when slack <= safety_factor · changeover, where
            slack = time left − work left.
    """

    name = "uniform_progress"

    def __init__(self, vms: int = 1, changeover: float = 600.0, safety_factor: float = 2.0):
        checked_vms("vms", vms)
        for key, value in (("changeover", changeover), ("safety_factor", safety_factor)):
            if not value >= 0:  # NaN too: the safety net (slack <= nan) never fired
                raise ValueError(f"{key}={value} must be >= 0")
        self.vms = vms
        self.changeover = float(changeover)
        self.safety_factor = float(safety_factor)
        self._on_demand = False
        self._pinned = False  # safety net fired: on-demand until the end

    def decide(self, ctx: ResourceContext) -> ResourceDecision:
        if ctx.deadline is None or ctx.work_total is None:
            return ResourceDecision(spot=self.vms, reason="no deadline: spot")
        d = ctx.changeover if ctx.changeover > 0 else self.changeover
        left = ctx.work_left or 0.0
        slack = (ctx.deadline - ctx.now) - left
        if self._pinned or slack <= self.safety_factor * d:
            self._pinned = self._pinned or left > 0
            self._on_demand = True
            return ResourceDecision(on_demand=self.vms, reason=f"safety net: slack {slack:.0f} s")
        target = ctx.work_total * min(max(ctx.now / ctx.deadline, 0.0), 1.0)
        lead = ctx.work_done - target  # seconds of work ahead of the uniform-progress line
        spot = ctx.spot_available is not False
        if self._on_demand:
            # Hysteresis: leave on-demand only with a lead worth two changeovers.
            if spot and lead >= 2.0 * d:
                self._on_demand = False
                return ResourceDecision(spot=self.vms, reason=f"lead {lead:.0f} s >= 2·{d:.0f}")
            return ResourceDecision(on_demand=self.vms, reason=f"on-demand, lead {lead:.0f} s")
        if spot:
            return ResourceDecision(spot=self.vms, reason="spot available")
        if lead < 0:
            self._on_demand = True
            return ResourceDecision(on_demand=self.vms, reason=f"behind by {-lead:.0f} s")
        return ResourceDecision(reason=f"no spot; ahead by {lead:.0f} s: wait")

    def state_dict(self) -> dict[str, Any]:
        return {"on_demand": self._on_demand, "pinned": self._pinned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._on_demand = bool(state.get("on_demand", False))
        self._pinned = bool(state.get("pinned", False))
