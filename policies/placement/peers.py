"""Peers every version, the object store every n-th version or every T seconds.

For multi-rank jobs (:class:`~pcframe.distributed.DistributedCheckpointer`): a tier named
``"peers"`` in a placement is the *peer tier*, copies of each rank's shard in the memory of
ranks on other nodes (:mod:`pcframe.distributed.replication`). Those copies survive the loss
of one node and restore faster than the object store, but not the loss of every node; the
object store survives anything and restores slowest. :class:`PeersThenRemote` puts every
version on local disk and in the peer tier, and uploads to the object store by a count
and/or a time rule. The time rule needs to remember when it last uploaded: learned state,
kept in :meth:`state_dict` (JSON) so a restart does not reset it.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

from pcframe.policies.placement.base import PlacementContext, PlacementDecision
from pcframe.policies.placement.tiered import TieredPlacement, TierRule
from pcframe.policies.registry import register

# The peer tier's name, as pcframe.distributed.job_tiers.PEERS (not imported: that module
# pulls in torch.distributed, and policies stay importable without it; a test checks both
# names agree).
PEERS_TIER = "peers"


class RemoteDue(Enum):
    """Why a version goes (or does not go) to the object store: the reason in decisions."""

    EVERY = "every n-th version"
    ELAPSED = "seconds since the last upload reached the interval"
    FIRST = "no version uploaded yet"
    CLOCK = "the clock went back since the last upload (a restarted process)"
    NOTICE = "preemption notice and the upload fits before the deadline"
    ASKED = "as decided when this version was first placed"
    NOT_DUE = "not due"

    @property
    def due(self) -> bool:
        return self is not RemoteDue.NOT_DUE


@register()
class PeersThenRemote(TieredPlacement):
    """Every version to local disk and the peer tier; the object store every
    ``remote_every``-th version and/or once ``remote_every_seconds`` have passed since the
    last version placed there.

    The first tier (``local_tier``) is the engine's own directory. On a preemption notice
    the version goes to the peer tier (the fastest tier that survives losing this node; the
    engine cannot time it, another component fills it) and also to the object store if its
    estimated write time fits before the deadline minus ``margin`` (or the notice has no
    deadline bound: ``inf``). Local disk takes it too (the engine's directory holds every
    version), so retention never drops the emergency version there.

    Only :class:`~pcframe.distributed.DistributedCheckpointer` fills the peer tier; a
    single-process :class:`~pcframe.Checkpointer` refuses a placement naming a tier it has
    not configured.

    Args:
        local_tier, peers_tier, remote_tier: tier names (``peers_tier`` must stay
            ``"peers"`` for the distributed engine to recognise the peer tier).
        remote_every: upload every n-th version (``None``: the time rule alone).
        remote_every_seconds: upload once this many seconds (``ctx.now``'s clock) have passed
            since the last version placed in the object store (``None``: the count rule
            alone). Evaluated by each rank on its own clock: in a multi-rank job ranks can
            pick different versions, so a version is complete in the object store only when
            the count rule chose it (or every rank's clock did).
        local_keep, peers_keep, remote_keep: versions kept per tier.
        local_survives_preemption: false for a spot VM's instance disk (lost with the VM).
        margin: seconds of the notice kept in reserve.
    """

    name = "peers_then_remote"

    def __init__(
        self,
        local_tier: str = "local",
        peers_tier: str = PEERS_TIER,
        remote_tier: str = "remote",
        remote_every: int | None = 10,
        remote_every_seconds: float | None = None,
        local_keep: int = 2,
        peers_keep: int = 2,
        remote_keep: int = 3,
        local_survives_preemption: bool = False,
        margin: float = 5.0,
    ) -> None:
        if remote_every is None and remote_every_seconds is None:
            raise ValueError(
                "PeersThenRemote needs remote_every (versions) or remote_every_seconds "
                "(seconds), or both, to know when to upload to the object store"
            )
        if remote_every is not None and (
            isinstance(remote_every, bool) or not isinstance(remote_every, int) or remote_every < 1
        ):
            raise ValueError(f"remote_every={remote_every!r} must be an int >= 1, or None")
        if remote_every_seconds is not None and not (
            isinstance(remote_every_seconds, int | float)
            and not isinstance(remote_every_seconds, bool)
            and math.isfinite(remote_every_seconds)
            and remote_every_seconds > 0
        ):
            raise ValueError(
                f"remote_every_seconds={remote_every_seconds!r} must be seconds > 0, or None"
            )
        super().__init__(
            [
                TierRule(local_tier, 1, local_keep, local_survives_preemption),
                TierRule(peers_tier, 1, peers_keep, survives_preemption=True),
                # `every` is informative only: place() applies the count and time rules.
                TierRule(remote_tier, remote_every or 1, remote_keep, survives_preemption=True),
            ],
            margin,
        )
        self.local_tier, self.peers_tier, self.remote_tier = local_tier, peers_tier, remote_tier
        self.remote_every = remote_every
        self.remote_every_seconds = (
            None if remote_every_seconds is None else float(remote_every_seconds)
        )
        # The engine asks about one version several times (at its commit, after each copy for
        # retention, rank 0 when it becomes global): the newest routine answer is remembered
        # so that a later ask, with a later clock, cannot turn "not due" into "due".
        self._asked_version: int | None = None
        self._asked_remote = False
        self._remote_version: int | None = None  # newest version placed in the object store
        self._remote_time: float | None = None  # ctx.now when it was placed there

    # --- decisions -----------------------------------------------------------------------------

    def place(self, ctx: PlacementContext) -> PlacementDecision:
        due = self._notice_remote(ctx) if ctx.notice is not None else self._routine_remote(ctx)
        tiers = [self.local_tier, self.peers_tier]
        if due.due:
            tiers.append(self.remote_tier)
        # A notice lists peers before local disk: the tier that matters for it comes first.
        ordered = [self.peers_tier, self.local_tier] if ctx.notice is not None else []
        ordered += [t for t in self._fastest_first(self._rules_of(tiers), ctx) if t not in ordered]
        what = "notice" if ctx.notice is not None else "routine placement"
        reason = f"version {ctx.version}: {what}; object store: {due.value}"
        return PlacementDecision(tuple(ordered), self._keep(ctx, set(ordered)), reason)

    def _rules_of(self, names: list[str]) -> list[TierRule]:
        return [r for r in self.rules if r.name in names]

    def _routine_remote(self, ctx: PlacementContext) -> RemoteDue:
        version = ctx.version
        if self._asked_version is not None and version <= self._asked_version:
            # Asked again about a version already decided (or an older one, for retention):
            # the answer given then; state does not move. An older version the time rule
            # chose reads "not due" here, which only narrows what its own write keeps: the
            # engine adds the version it just wrote to what a tier keeps anyway.
            if version == self._asked_version:
                return RemoteDue.ASKED if self._asked_remote else RemoteDue.NOT_DUE
            if version == self._remote_version or self._every_due(version):
                return RemoteDue.ASKED
            return RemoteDue.NOT_DUE
        due = self._due(version, ctx.now)
        self._asked_version, self._asked_remote = version, due.due
        if due.due:
            self._uploaded(version, ctx.now)
        return due

    def _due(self, version: int, now: float) -> RemoteDue:
        if self._every_due(version):
            return RemoteDue.EVERY
        seconds = self.remote_every_seconds
        if seconds is None:
            return RemoteDue.NOT_DUE
        if self._remote_time is None:
            # Nothing uploaded (a new job, or a restart without this state): upload now,
            # so that frequent restarts cannot keep the object store empty.
            return RemoteDue.FIRST
        if now < self._remote_time:
            # The last upload's time is on another process's clock: its age is unknown.
            return RemoteDue.CLOCK
        return RemoteDue.ELAPSED if now - self._remote_time >= seconds else RemoteDue.NOT_DUE

    def _every_due(self, version: int) -> bool:
        return self.remote_every is not None and version % self.remote_every == 0

    def _notice_remote(self, ctx: PlacementContext) -> RemoteDue:
        """The object store takes an emergency version only if the upload fits the window."""
        assert ctx.notice is not None
        deadline = ctx.notice.deadline
        if deadline is None:  # no deadline given: the window is unknown, peers only
            return RemoteDue.NOT_DUE
        left = deadline - ctx.now - self.margin
        seconds = ctx.tier_write_times.get(self.remote_tier)
        unbounded = math.isinf(left) and left > 0
        if not (unbounded or (seconds is not None and seconds <= left)):
            return RemoteDue.NOT_DUE
        if self._remote_version is None or ctx.version >= self._remote_version:
            self._uploaded(ctx.version, ctx.now)
        if ctx.version == self._asked_version:  # a later routine ask gets the same answer
            self._asked_remote = True
        return RemoteDue.NOTICE

    def _uploaded(self, version: int, now: float) -> None:
        self._remote_version, self._remote_time = version, float(now)

    # --- learned state -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "asked_version": self._asked_version,
            "asked_remote": self._asked_remote,
            "remote_version": self._remote_version,
            # JSON has no infinity; a clock is finite anyway, but never write a bad file.
            "remote_time": _finite_or_none(self._remote_time),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._asked_version = _int_or_none(state.get("asked_version"))
        self._asked_remote = bool(state.get("asked_remote", False))
        self._remote_version = _int_or_none(state.get("remote_version"))
        remote_time = state.get("remote_time")
        self._remote_time = None if remote_time is None else float(remote_time)


def _int_or_none(x: Any) -> int | None:
    return None if x is None else int(x)


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
