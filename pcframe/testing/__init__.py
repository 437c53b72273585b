"""Test kits for pcframe plugins (needs pytest). See :mod:`pcframe.testing.policy_conformance`."""

from pcframe.testing.interval_conformance import IntervalDriver, IntervalPolicyConformance
from pcframe.testing.kit import json_round_trip
from pcframe.testing.policy_conformance import (
    PlacementPolicyConformance,
    PredictorConformance,
    ResourcePolicyConformance,
)

__all__ = [
    "IntervalDriver",
    "IntervalPolicyConformance",
    "PlacementPolicyConformance",
    "PredictorConformance",
    "ResourcePolicyConformance",
    "json_round_trip",
]
