"""Pluggable checkpoint interval, placement and resource policies (``pcframe.policies``)."""

from pcframe.policies.base import (
    Decision,
    Event,
    IntervalPolicy,
    Notice,
    PolicyContext,
    Preempted,
    Restarted,
    SaveCompleted,
    Stateful,
)
from pcframe.policies.fixed import FixedSteps

__all__ = [
    "Decision",
    "Event",
    "FixedSteps",
    "IntervalPolicy",
    "Notice",
    "PolicyContext",
    "Preempted",
    "Restarted",
    "SaveCompleted",
    "Stateful",
]
