"""Placement policies: storage tier(s) per checkpoint version, and retention per tier."""

from pcframe.policies.placement.base import PlacementContext, PlacementDecision, PlacementPolicy
from pcframe.policies.placement.presets import LocalPlusRemote, MemoryThenDisk, SingleTier
from pcframe.policies.placement.tiered import TieredPlacement, TierRule

__all__ = [
    "LocalPlusRemote",
    "MemoryThenDisk",
    "PlacementContext",
    "PlacementDecision",
    "PlacementPolicy",
    "SingleTier",
    "TierRule",
    "TieredPlacement",
]
