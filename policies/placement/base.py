"""Placement: which storage tier(s) a checkpoint version goes to, and what each tier keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pcframe.policies.base import Event, Notice, Stateful
from pcframe.policies.kinds import plugin_base


@dataclass(frozen=True)
class PlacementContext:
    """What the engine knows when version ``version`` (of step ``step``) is about to be written.

    Attributes:
        tier_write_times: estimated seconds to make this version durable in each tier the
            engine has configured (name -> seconds); tiers missing here are unknown.
        committed: versions already committed per tier, any order.
        notice: a pending preemption notice, if any.
    """

    version: int
    step: int
    now: float
    tier_write_times: Mapping[str, float] = field(default_factory=dict)
    committed: Mapping[str, Sequence[int]] = field(default_factory=dict)
    notice: Notice | None = None


@dataclass(frozen=True)
class PlacementDecision:
    """What the engine must do with the version.

    Attributes:
        tiers: tier names to write the version to, in order (fastest first).
        keep: per tier, the versions to keep once ``version`` has committed there; the
            engine may delete every other version of that tier *after* that commit (never
            before, so a failed write never costs the newest committed version).
        reason: human-readable, for logs.
    """

    tiers: tuple[str, ...]
    keep: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    reason: str = ""


@plugin_base("placement")
class PlacementPolicy(Stateful, ABC):
    """Chooses tiers and retention for every checkpoint version."""

    name: ClassVar[str] = ""

    @property
    @abstractmethod
    def tiers(self) -> tuple[str, ...]:
        """Every tier name this policy may ask for (the engine checks they are configured)."""

    @abstractmethod
    def place(self, ctx: PlacementContext) -> PlacementDecision:
        """Tiers and retention for ``ctx.version``."""

    def observe(self, event: Event) -> None:
        """Learn from what happened (e.g. measured write times)."""
