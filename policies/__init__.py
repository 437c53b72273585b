"""Pluggable checkpoint interval, placement and resource policies (``pcframe.policies``).

Importing this package registers every shipped policy under its ``name`` (see
:func:`available`); third-party plugins come in through the entry-point group
``pcframe.policies``.
"""

from pcframe.policies.base import (
    Decision,
    Event,
    IntervalPolicy,
    Notice,
    PolicyContext,
    Preempted,
    Restarted,
    SaveCompleted,
    SaveHint,
    Stateful,
)
from pcframe.policies.checkfreq import CheckFreq, checkfreq_k
from pcframe.policies.daly import Daly
from pcframe.policies.errors import PluginError
from pcframe.policies.estimates import CostModel, RunningEstimate
from pcframe.policies.fixed import FixedSteps
from pcframe.policies.fixed_time import FixedTime
from pcframe.policies.notice_driven import NoticeDriven
from pcframe.policies.notices import (
    FileNoticeSource,
    ManualNoticeSource,
    MetadataNoticeSource,
    NoticeSource,
    SignalNoticeSource,
)
from pcframe.policies.overhead_budget import OverheadBudget
from pcframe.policies.periodic import SecondsIntervalPolicy
from pcframe.policies.placement import (
    LocalPlusRemote,
    MemoryThenDisk,
    PeersThenRemote,
    PlacementContext,
    PlacementDecision,
    PlacementPolicy,
    SingleTier,
    TieredPlacement,
    TierRule,
)
from pcframe.policies.predictors import (
    Estimate,
    EwmaRate,
    GammaPoissonRate,
    HazardByTimeOfDay,
    Prediction,
    Predictor,
    WindowedPoisson,
)
from pcframe.policies.preemption_aware import PreemptionAware
from pcframe.policies.registry import (
    ENTRY_POINT_GROUP,
    Registry,
    available,
    create,
    get,
    refresh,
    register,
)
from pcframe.policies.resource import (
    HybridAvailability,
    OnDemandOnly,
    ResourceContext,
    ResourceDecision,
    ResourcePolicy,
    SpotOnly,
    UniformProgress,
)
from pcframe.policies.young import Young

__all__ = [
    "ENTRY_POINT_GROUP",
    "CheckFreq",
    "CostModel",
    "Daly",
    "Decision",
    "Estimate",
    "Event",
    "EwmaRate",
    "FileNoticeSource",
    "FixedSteps",
    "FixedTime",
    "GammaPoissonRate",
    "HazardByTimeOfDay",
    "HybridAvailability",
    "IntervalPolicy",
    "LocalPlusRemote",
    "ManualNoticeSource",
    "MemoryThenDisk",
    "MetadataNoticeSource",
    "Notice",
    "NoticeDriven",
    "NoticeSource",
    "OnDemandOnly",
    "OverheadBudget",
    "PeersThenRemote",
    "PlacementContext",
    "PlacementDecision",
    "PlacementPolicy",
    "PluginError",
    "PolicyContext",
    "Prediction",
    "Predictor",
    "Preempted",
    "PreemptionAware",
    "Registry",
    "ResourceContext",
    "ResourceDecision",
    "ResourcePolicy",
    "Restarted",
    "RunningEstimate",
    "SaveCompleted",
    "SaveHint",
    "SecondsIntervalPolicy",
    "SignalNoticeSource",
    "SingleTier",
    "SpotOnly",
    "Stateful",
    "TierRule",
    "TieredPlacement",
    "UniformProgress",
    "WindowedPoisson",
    "Young",
    "available",
    "checkfreq_k",
    "create",
    "get",
    "refresh",
    "register",
]
