"""Rule-based tiered placement: every k-th version to a tier, last n kept, notice-aware."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pcframe.policies.placement.base import PlacementContext, PlacementDecision, PlacementPolicy
from pcframe.runtime.checks import whole_number


@dataclass(frozen=True)
class TierRule:
    """One tier: write every ``every``-th version there, keep the newest ``keep`` versions.

    ``survives_preemption`` says whether a checkpoint in this tier outlives the VM (tmpfs and
    instance-store NVMe do not; a persistent disk or an object store does). Only such tiers
    are candidates for a save that answers a preemption notice.
    """

    name: str
    every: int = 1
    keep: int = 2
    survives_preemption: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tier needs a name")
        # Whole numbers: NaN and 1.5 passed ``< 1``, and every place() then failed on a
        # slice (reported as the policy failing to place each version, not as this key).
        if not all(whole_number(n) and n >= 1 for n in (self.every, self.keep)):
            raise ValueError(
                f"tier {self.name!r}: every={self.every!r} and keep={self.keep!r} must be "
                "whole numbers >= 1"
            )


class TieredPlacement(PlacementPolicy):
    """Generic rule-based placement; the shipped presets are subclasses.

    Routine versions go to every tier whose ``every`` divides the version number. With a
    preemption notice the version goes to exactly one tier: the fastest (by the engine's
    estimate) among those that survive preemption and can finish ``margin`` seconds before
    the deadline; if none can, to the fastest surviving tier anyway (best effort).
    """

    def __init__(self, rules: Sequence[TierRule], margin: float = 5.0) -> None:
        if not rules:
            raise ValueError("TieredPlacement needs at least one tier rule")
        names = [r.name for r in rules]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if not margin >= 0:  # NaN too: no deadline would ever fit it
            raise ValueError(f"margin={margin} must be >= 0 seconds")
        self.rules = tuple(rules)
        self.margin = float(margin)

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rules)

    def place(self, ctx: PlacementContext) -> PlacementDecision:
        if ctx.notice is not None:
            chosen, reason = self._on_notice(ctx)
        else:
            chosen = [r for r in self.rules if ctx.version % r.every == 0]
            if not chosen:  # no rule due: the first tier always takes a version
                chosen = [self.rules[0]]
            reason = f"version {ctx.version}: routine placement"
        tiers = self._fastest_first(chosen, ctx)
        return PlacementDecision(tuple(tiers), self._keep(ctx, set(tiers)), reason)

    def _on_notice(self, ctx: PlacementContext) -> tuple[list[TierRule], str]:
        assert ctx.notice is not None
        left = ctx.notice.deadline - ctx.now - self.margin
        durable = [r for r in self.rules if r.survives_preemption] or list(self.rules)
        ranked = self._fastest_first(durable, ctx)
        by_name = {r.name: r for r in self.rules}
        for name in ranked:
            t = ctx.tier_write_times.get(name)
            if t is not None and t <= left:
                return [by_name[name]], f"notice: {name} writes in ~{t:.1f} s <= {left:.1f} s"
        return [by_name[ranked[0]]], f"notice: no tier fits {left:.1f} s; best effort"

    @staticmethod
    def _fastest_first(rules: Sequence[TierRule], ctx: PlacementContext) -> list[str]:
        # Unknown write times sort last but keep their configured order (stable sort).
        return [
            r.name for r in sorted(rules, key=lambda r: ctx.tier_write_times.get(r.name, math.inf))
        ]

    def _keep(self, ctx: PlacementContext, written: set[str]) -> dict[str, tuple[int, ...]]:
        keep: dict[str, tuple[int, ...]] = {}
        for r in self.rules:
            versions = {int(v) for v in ctx.committed.get(r.name, ())}
            if r.name in written:
                versions.add(ctx.version)
            keep[r.name] = tuple(sorted(versions)[-r.keep :]) if versions else ()
        return keep

    def state_dict(self) -> dict[str, Any]:
        return {}  # purely rule-based: nothing learned
