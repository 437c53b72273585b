"""The two baselines: always spot, always on-demand."""

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
class SpotOnly(ResourcePolicy):
    """Always ask for ``vms`` spot VMs (and wait while none can be had)."""

    name = "spot_only"

    def __init__(self, vms: int = 1) -> None:
        self.vms = checked_vms("vms", vms)

    def decide(self, ctx: ResourceContext) -> ResourceDecision:
        return ResourceDecision(spot=self.vms, reason="spot only")

    def state_dict(self) -> dict[str, Any]:
        return {}


@register()
class OnDemandOnly(ResourcePolicy):
    """Always run ``vms`` on-demand VMs."""

    name = "on_demand_only"

    def __init__(self, vms: int = 1) -> None:
        self.vms = checked_vms("vms", vms)

    def decide(self, ctx: ResourceContext) -> ResourceDecision:
        return ResourceDecision(on_demand=self.vms, reason="on-demand only")

    def state_dict(self) -> dict[str, Any]:
        return {}
