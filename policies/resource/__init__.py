"""Resource policies for the simulator: spot vs on-demand and how many spot VMs."""

from pcframe.policies.resource.base import (
    ResourceContext,
    ResourceDecision,
    ResourcePolicy,
    checked_resource_decision,
)
from pcframe.policies.resource.hybrid import HybridAvailability
from pcframe.policies.resource.simple import OnDemandOnly, SpotOnly
from pcframe.policies.resource.uniform_progress import UniformProgress

__all__ = [
    "HybridAvailability",
    "OnDemandOnly",
    "ResourceContext",
    "ResourceDecision",
    "ResourcePolicy",
    "SpotOnly",
    "UniformProgress",
    "checked_resource_decision",
]
