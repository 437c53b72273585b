"""Test kits for pcframe plugins (needs pytest). See :mod:`pcframe.testing.policy_conformance`."""

from pcframe.testing.policy_conformance import (
    IntervalDriver,
    IntervalPolicyConformance,
    PlacementPolicyConformance,
    PredictorConformance,
    ResourcePolicyConformance,
    json_round_trip,
)

__all__ = [
    "IntervalDriver",
    "IntervalPolicyConformance",
    "PlacementPolicyConformance",
    "PredictorConformance",
    "ResourcePolicyConformance",
    "json_round_trip",
]
