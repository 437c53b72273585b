"""Where each version is placed, which versions survive a preemption, what a restore costs.

Off by default: without a placement policy the simulator keeps its one-tier model (every
durable version survives, every restart costs ``job.restart_cost``). Given the placement
policy the engine would use (:func:`~pcframe.sim.simulate`'s ``placement``), every save asks
it, as the engine does at each commit, which tiers the version goes to (and, for an
emergency save, asks again with the notice, as :meth:`Tiers.secure` does). A preemption of
a spot VM takes its local disk and memory: the restart reads the newest version durable in
a tier that survives, from the one of its tiers with the shortest restart time
(``job.restart_by_tier``), and work after that version is lost.

Which tiers survive: a :class:`~pcframe.policies.TieredPlacement` says so per tier
(``TierRule.survives_preemption``: a spot VM's local disk and tmpfs do not, a persistent
disk, the peer tier and an object store do); another placement policy's ``"peers"`` and
``"remote"`` tiers survive, its others do not. The peer tier counts as surviving every
preemption: one preemption is modelled as the loss of one node, whose shards other nodes
hold. A copy is taken to be in every tier the placement names once the version is durable
(uploads are not timed).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from pcframe.errors import PolicyError, SimConfigError
from pcframe.policies.base import Notice
from pcframe.policies.placement import (
    PEERS_TIER,
    PlacementContext,
    PlacementDecision,
    PlacementPolicy,
    TieredPlacement,
    ask_placement,
)
from pcframe.sim.spec import JobSpec
from pcframe.sim.state import SaveCost, saved_state

# Tiers of a placement that is not a TieredPlacement that survive a preemption, by name.
SURVIVING_BY_NAME = frozenset({PEERS_TIER, "remote"})
_COMMITTED_SHOWN = 8  # versions per tier the placement sees in ctx.committed


class TierFate(Enum):
    """What a preemption of the job's spot VM does to a tier's versions."""

    LOST = "lost with the VM"  # a spot VM's instance disk, tmpfs
    SURVIVES = "survives"  # peers on other nodes, an object store, a persistent disk


def tier_fates(placement: PlacementPolicy) -> dict[str, TierFate]:
    """Each tier of ``placement`` and what a preemption does to it (see the module)."""
    if isinstance(placement, TieredPlacement):
        return {
            r.name: TierFate.SURVIVES if r.survives_preemption else TierFate.LOST
            for r in placement.rules
        }
    return {
        t: TierFate.SURVIVES if t in SURVIVING_BY_NAME else TierFate.LOST for t in placement.tiers
    }


@dataclass(frozen=True)
class Placed:
    """A version placed in at least one surviving tier: a possible restore point."""

    version: int
    step: int
    durable_at: float
    tiers: frozenset[str]  # its surviving tiers
    policy_state: Any  # the interval policy's state the version holds
    placement_state: Any  # the placement policy's state right after placing it
    life: int  # index of the process that wrote it
    cost: SaveCost  # what its save cost, as the version records it (Commit.cost)


@dataclass(frozen=True)
class PlacementsSnapshot:
    """What :meth:`Placements.restore` goes back to (a fast-forward stretch's rollback)."""

    entries: tuple[Placed, ...]
    committed: dict[str, tuple[tuple[int, float], ...]]
    placement_state: Any


class Placements:
    """The placement policy's answers for one simulated job, and what survives a preemption.

    Args:
        placement: the policy, asked at every save (mutated by the run: a fresh object per
            simulation, as for the interval policy).
        job: ``restart_by_tier`` (seconds from VMs to training when restoring from a tier;
            a tier not listed costs ``restart_cost``; tiers the placement lacks are
            ignored), ``save_duration`` (the primary tier's write time the policy is told).
    """

    def __init__(self, placement: PlacementPolicy, job: JobSpec) -> None:
        tiers = tuple(placement.tiers)
        if not tiers:
            raise PolicyError(f"placement {type(placement).__name__} names no tier")
        self.placement = placement
        self.fates = tier_fates(placement)
        self.surviving = frozenset(t for t, f in self.fates.items() if f is TierFate.SURVIVES)
        self.primary = tiers[0]  # the engine's own directory
        restart = dict(job.restart_by_tier or {})
        if restart and not set(restart) & set(tiers):
            # Tiers another placement has are ignored (one mapping serves a sweep over
            # placements), but a mapping naming none of this one's is a mistake.
            raise SimConfigError(
                f"job.restart_by_tier: {sorted(restart)} names no tier of placement "
                f"{_name(placement)} (its tiers: {list(tiers)}); name those tiers"
            )
        self.restart = {t: s for t, s in restart.items() if t in tiers}
        self.restart_cost = job.restart_cost
        self.write_times = {self.primary: job.save_duration}
        self.initial_state = saved_state(placement)
        self.entries: list[Placed] = []
        self._committed: dict[str, deque[tuple[int, float]]] = {
            t: deque(maxlen=_COMMITTED_SHOWN) for t in tiers
        }
        self.source: str | None = None  # the tier the next restore reads from
        self.restored: Placed | None = None  # the version it restores
        self.restores: dict[str, int] = {}  # restores per tier, for the result

    # --- placing --------------------------------------------------------------------------------
    def place(
        self,
        version: int,
        step: int,
        start: float,
        durable_at: float,
        *,
        now: float,
        notice: Notice | None,
        policy_state: Any,
        cost: SaveCost,
        life: int,
    ) -> None:
        """Ask the placement where ``version`` goes (saved at ``start``, durable at
        ``durable_at``); ``now`` is a time no later kill can precede (old restore points
        before the newest surviving version durable by then are forgotten)."""
        ctx = PlacementContext(
            version, step, start, dict(self.write_times), self._committed_at(start), None
        )
        tiers = set(self._decide(ctx).tiers)
        if notice is not None:  # the engine's commit, then its notice path (Tiers.secure)
            tiers |= set(self._decide(replace(ctx, notice=notice)).tiers)
        for tier in tiers:
            if (version, durable_at) not in self._committed[tier]:  # asked again: once
                self._committed[tier].append((version, durable_at))
        kept = frozenset(tiers) & self.surviving
        if kept:
            state = saved_state(self.placement)
            entry = Placed(version, step, durable_at, kept, policy_state, state, life, cost)
            self._add(entry)
        if len(self.entries) > 2 * _COMMITTED_SHOWN:
            self._forget_before(now)

    def secure(
        self,
        version: int,
        step: int,
        durable_at: float,
        *,
        at: float,
        life: int,
        policy_state: Any,
        cost: SaveCost,
    ) -> None:
        """A planned stop: ask again about ``version`` with an unbounded notice (the stop
        waits for the version), as the engine's notice path would."""
        self.place(
            version,
            step,
            at,
            durable_at,
            now=at,
            notice=Notice(at, math.inf, "planned stop"),
            policy_state=policy_state,
            cost=cost,
            life=life,
        )

    def _decide(self, ctx: PlacementContext) -> PlacementDecision:
        """The placement's answer, checked as the engine checks it (one contract)."""
        return ask_placement(self.placement, ctx, tuple(self.fates))

    def _add(self, entry: Placed) -> None:
        last = self.entries[-1] if self.entries else None
        if last is not None and (last.version, last.step) == (entry.version, entry.step):
            # Asked again (a planned stop's notice, about the newest version): both hold.
            self.entries[-1] = replace(entry, tiers=last.tiers | entry.tiers)
            return
        self.entries.append(entry)

    def _committed_at(self, now: float) -> dict[str, tuple[int, ...]]:
        return {
            tier: tuple(v for v, durable in placed if durable <= now)
            for tier, placed in self._committed.items()
        }

    def _forget_before(self, now: float) -> None:
        newest = self._newest(now)
        if newest is not None:
            self.entries = self.entries[newest:]

    def _newest(self, at: float) -> int | None:
        """Index of the newest entry durable by ``at`` (entries are in step order)."""
        for i in range(len(self.entries) - 1, -1, -1):
            if self.entries[i].durable_at <= at:
                return i
        return None

    # --- preemptions and restarts ---------------------------------------------------------
    def survivor(self, at: float) -> Placed | None:
        """The version a restart after losing the VMs at ``at`` restores (``None``: none)."""
        i = self._newest(at)
        return None if i is None else self.entries[i]

    def floor(self, now: float) -> int:
        """The oldest version a kill at ``now`` or later can restore (0: nothing yet)."""
        found = self.survivor(now)
        return 0 if found is None else found.version

    def lose(self, at: float) -> Placed | None:
        """The job's VMs are gone at ``at``: keep the restore point, forget the rest (later
        versions were lost or still in flight). Returns it (``None``: start from scratch)."""
        found = self.survivor(at)
        self.entries = [] if found is None else [found]
        for tier, placed in self._committed.items():
            kept = [(v, d) for v, d in placed if tier in self.surviving and d <= at]
            self._committed[tier] = deque(kept, maxlen=_COMMITTED_SHOWN)
        self.restored = found
        self.source = None
        if found is not None:  # the fastest tier holding it; config order breaks ties
            self.source = min((t for t in self.fates if t in found.tiers), key=self._restart_of)
        return found

    def _restart_of(self, tier: str) -> float:
        return self.restart.get(tier, self.restart_cost)

    def restart_base(self, restored: bool) -> float:
        """Seconds from VMs to training for the next start (before any jitter)."""
        if not restored or self.source is None:
            return self.restart_cost
        self.restores[self.source] = self.restores.get(self.source, 0) + 1
        return self._restart_of(self.source)

    def state_to_restore(self, restored: bool) -> Any:
        """The placement state the restored version holds (the initial one without it)."""
        if restored and self.restored is not None:
            return copy.deepcopy(self.restored.placement_state)
        return copy.deepcopy(self.initial_state)

    # --- fast-forward rollbacks -----------------------------------------------------------
    def snapshot(self) -> PlacementsSnapshot:
        return PlacementsSnapshot(
            tuple(self.entries),
            {t: tuple(placed) for t, placed in self._committed.items()},
            saved_state(self.placement),
        )

    def restore(self, snap: PlacementsSnapshot) -> None:
        self.entries = list(snap.entries)
        self._committed = {
            t: deque(placed, maxlen=_COMMITTED_SHOWN) for t, placed in snap.committed.items()
        }
        self.placement.load_state_dict(copy.deepcopy(snap.placement_state))


def placement_name(placement: PlacementPolicy | None) -> str:
    return "" if placement is None else _name(placement)


def _name(policy: Any) -> str:
    return getattr(policy, "name", "") or type(policy).__name__


def check_restart_inputs(job: JobSpec, placement: PlacementPolicy | None) -> None:
    """Per-tier restart times need a placement policy to say where versions are."""
    if job.restart_by_tier and placement is None:
        raise SimConfigError(
            "job.restart_by_tier needs a placement policy to say which tiers hold each "
            "version: simulate(..., placement=P.PeersThenRemote()) or, in pcframe-sim, "
            "policy/placement=peers_then_remote"
        )


__all__ = [
    "SURVIVING_BY_NAME",
    "Placed",
    "Placements",
    "PlacementsSnapshot",
    "TierFate",
    "check_restart_inputs",
    "placement_name",
    "tier_fates",
]
