"""Placement policies: storage tier(s) per checkpoint version, and retention per tier."""

from pcframe.policies.placement.base import (
    PlacementContext,
    PlacementDecision,
    PlacementPolicy,
    ask_placement,
    checked_placement,
)
from pcframe.policies.placement.peers import PEERS_TIER, PeersThenRemote, RemoteDue
from pcframe.policies.placement.presets import LocalPlusRemote, MemoryThenDisk, SingleTier
from pcframe.policies.placement.tiered import TieredPlacement, TierRule

__all__ = [
    "PEERS_TIER",
    "LocalPlusRemote",
    "MemoryThenDisk",
    "PeersThenRemote",
    "PlacementContext",
    "PlacementDecision",
    "PlacementPolicy",
    "RemoteDue",
    "SingleTier",
    "TierRule",
    "TieredPlacement",
    "ask_placement",
    "checked_placement",
]
