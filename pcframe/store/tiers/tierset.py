"""``Tiers``: the primary checkpoint directory plus replica tiers, driven by a placement policy.

The engine writes every version to its own directory, the *primary* tier (local disk, or
tmpfs for a memory tier). After each commit the placement policy says which other tiers get
the version and what each tier keeps; one :class:`Replicator` per replica tier copies it in
the background. The primary's retention is narrowed so it never deletes a version a replica
still has to copy. On a preemption notice, :meth:`Tiers.secure` asks the placement policy for
the fastest tier that survives the VM and fits before the deadline, and waits until the
version is there. Restores consider every tier: newest version first, primary before local
replicas before remote ones, falling back tier by tier and then version by version.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pcframe.errors import PolicyError, TierError
from pcframe.policies.base import Notice
from pcframe.policies.placement import (
    PlacementContext,
    PlacementDecision,
    PlacementPolicy,
    TieredPlacement,
    TierRule,
    ask_placement,
)
from pcframe.runtime.checks import bounded_wait, require_object, whole_number
from pcframe.store.directory import WritableCheckpointDir
from pcframe.store.retention import KeepWhere
from pcframe.store.tiers.base import Tier, number_option
from pcframe.store.tiers.local import LocalTier
from pcframe.store.tiers.memory import is_memory_backed
from pcframe.store.tiers.replicator import Job, Replicator, TierStatus
from pcframe.store.tiers.sources import Source, tier_sources
from pcframe.store.tiers.specs import TierSpec, make_tier

if TYPE_CHECKING:
    from pcframe.save.pipeline import SavePipeline

log = logging.getLogger("pcframe.store.tiers")


@dataclass(frozen=True)
class Secured:
    """Result of :meth:`Tiers.secure`: where the emergency version is, and whether in time."""

    version: int
    tiers: tuple[str, ...]
    durable: bool
    reason: str


class Tiers:
    """Replica tiers and the placement policy of one :class:`~pcframe.Checkpointer`.

    Args:
        replicas: tier name -> where (see :func:`make_tier`). The Checkpointer's directory is
            the primary tier; do not list it here.
        placement: which tiers get each version and what each keeps. Its first tier is the
            primary (e.g. ``MemoryThenDisk()`` names the Checkpointer's directory "memory",
            ``LocalPlusRemote()`` names it "local"). Default: the primary is called
            "primary" and every replica gets every version, keeping the engine's
            ``keep_last``.
        retries, backoff, backoff_max: per version and tier, attempts after the first and
            the exponential backoff between them (seconds).
        drain_timeout: seconds :meth:`close` waits for queued replication before aborting it.
        secure_timeout: how long :meth:`secure` waits when the notice has no deadline.
        external: tier names the placement may name that someone else fills (the peer tier
            of a multi-rank job: :mod:`pcframe.distributed.job_tiers`); no replica here.

    :meth:`primary_only` is the null object a Checkpointer without tiers uses: the primary
    directory alone, no replication, no placement, restore sources from the primary.
    """

    @classmethod
    def primary_only(cls) -> Tiers:
        """No replica tiers and no placement: restores read the primary; nothing is copied."""
        tiers = cls({})
        tiers.replicated = False
        return tiers

    def __init__(
        self,
        replicas: Mapping[str, TierSpec],
        placement: PlacementPolicy | None = None,
        *,
        retries: int = 5,
        backoff: float = 0.5,
        backoff_max: float = 30.0,
        drain_timeout: float = 30.0,
        secure_timeout: float = 120.0,
        external: Collection[str] = (),
    ) -> None:
        if not whole_number(retries) or retries < 0:
            raise TierError(f"tiers: retries={retries!r}: give a whole number >= 0")
        backoff = number_option(backoff, "tiers: backoff", low=0, low_ok=False)
        backoff_max = number_option(backoff_max, "tiers: backoff_max", low=backoff, low_ok=True)
        drain_timeout = number_option(drain_timeout, "tiers: drain_timeout", low=0, low_ok=True)
        secure_timeout = number_option(secure_timeout, "tiers: secure_timeout", low=0, low_ok=True)
        if not isinstance(replicas, Mapping):
            raise TierError(
                f"tiers: {type(replicas).__name__} given; give a mapping of tier name to where, "
                "e.g. {'remote': 's3://bucket/run'}"
            )
        self.replicas: dict[str, Tier] = {}
        try:
            for name, spec in replicas.items():
                self.replicas[name] = make_tier(name, spec)
        except BaseException:
            self._close_tiers()
            raise
        self.placement = placement
        self.retries, self.backoff, self.backoff_max = retries, backoff, backoff_max
        self.drain_timeout = drain_timeout
        self.secure_timeout = secure_timeout
        self.external = frozenset(external)
        # False only for the null object: no tier names, no placement, nothing to replicate.
        self.replicated = True
        self.primary_name = ""
        self.primary: WritableCheckpointDir | None = None
        self._replicators: dict[str, Replicator] = {}
        self._primary_keep: set[int] = set()
        # Per replica tier, versions kept whatever the placement says (a multi-rank job's
        # newest version whole in the object store: :meth:`hold`).
        self._held: dict[str, set[int]] = {}
        self._primary_seconds: float | None = None
        self._delta_versions: set[int] = set()
        self._unlisted: set[str] = set()  # tiers not listed at attach (list_later)
        self._closed_remote: tuple[str, list[int]] | None = None  # remote() once closed
        self._lock = threading.Lock()
        # The placement's tiers as attach found them: what every answer is checked against.
        self._names: tuple[str, ...] = ()
        # A failure of the placement on the commit or a replica thread, with the version it
        # was about, that the engine has not raised yet (:meth:`take_failure`): one at a time.
        self._failure: tuple[int, PolicyError] | None = None
        self._failure_lock = threading.Lock()

    # --- wiring --------------------------------------------------------------------------

    def list_later(self, name: str) -> None:
        """Do not list tier ``name`` in :meth:`attach`: its worker lists it in the background
        before its first write, and sweeps it after each write (not when it starts), and
        whoever opens the engine numbers new versions above that tier's itself (a multi-rank
        job: rank 0 lists the object store once for every rank,
        :func:`pcframe.distributed.job_tiers.start_job_listing`; a sweep at the worker's start
        built every rank's object-store client while the ranks restarted, 0.26 CPU-s each)."""
        if name not in self.replicas:
            raise TierError(f"tiers.{name}: no such replica tier (have {sorted(self.replicas)})")
        self._unlisted.add(name)

    def attach(self, primary: WritableCheckpointDir, keep_last: int) -> int:
        """Bind to the engine's directory, list every replica, start the workers.

        Returns the newest version found in any replica (0 if none), so the engine numbers
        new versions above it.
        """
        self.primary = primary
        if not self.replicated:
            return 0  # the primary alone: sources are its versions, under no tier name
        self.primary_name = self.placement.tiers[0] if self.placement else "primary"
        if self.primary_name in self.replicas:
            raise TierError(
                f"tiers.{self.primary_name}: this tier is the Checkpointer's own directory "
                f"({primary.root}), the first tier of the placement policy; remove it from tiers="
            )
        if self.placement is None:  # every tier every version; a notice picks one that
            # outlives the VM (not a RAM-backed primary beside a disk)
            rules = [TierRule(self.primary_name, 1, keep_last, not is_memory_backed(primary.root))]
            rules += [
                TierRule(name, 1, keep_last, not _ram_backed(tier))
                for name, tier in self.replicas.items()
            ]
            self.placement = TieredPlacement(rules)
        self._validate(primary)
        self._names = tuple(self.placement.tiers)
        newest = 0
        for name, tier in self._ordered():
            try:
                committed: list[int] | None = None
                if name not in self._unlisted:
                    committed = tier.committed_versions()
                newest = max([newest, *(committed or ())])
            except TierError as exc:
                if tier.local:  # locked by another writer, or unusable: fail at start-up
                    self.close()
                    raise
                log.warning("%s (replication will retry)", exc)
                committed = None
            self._replicators[name] = Replicator(
                tier,
                primary.path,
                lambda job, listed, name=name: self._keep(name, job, listed),
                retries=self.retries,
                backoff=self.backoff,
                backoff_max=self.backoff_max,
                committed=committed,
                sweep_at_start=name not in self._unlisted,
            )
        return newest

    def _validate(self, primary: WritableCheckpointDir) -> None:
        assert self.placement is not None
        wanted = set(self.placement.tiers[1:]) - self.external
        missing = sorted(wanted - set(self.replicas))
        if missing:
            raise TierError(
                f"placement {type(self.placement).__name__} writes to tier(s) {missing} that are "
                f"not configured: pass tiers={{{missing[0]!r}: '/path' or 's3://bucket/prefix'}}"
            )
        unused = sorted(set(self.replicas) - wanted)
        if unused:
            raise TierError(
                f"tiers {unused} are configured but placement {type(self.placement).__name__} "
                f"(tiers {list(self.placement.tiers)}) never writes there: add a TierRule for "
                "them or remove them"
            )
        for rule in getattr(self.placement, "rules", ()):
            tier = self.replicas.get(rule.name)
            path = primary.root if rule.name == self.primary_name else getattr(tier, "path", None)
            if rule.survives_preemption and path is not None and is_memory_backed(path):
                log.warning(
                    "tier %r (%s) is RAM-backed: it does not outlive the VM, whatever its rule "
                    "says; a preemption notice does not count a version there as safe",
                    rule.name,
                    path,
                )
        for name, tier in self.replicas.items():
            if isinstance(tier, LocalTier) and tier.path.resolve() == primary.root.resolve():
                raise TierError(
                    f"tiers.{name}: {tier.path} is the Checkpointer's own directory; a replica "
                    "needs another directory"
                )

    def _ordered(self) -> list[tuple[str, Tier]]:
        """Local replicas before remote ones (cheaper to restore from), else as configured."""
        return sorted(self.replicas.items(), key=lambda item: not item[1].local)

    # --- engine hooks --------------------------------------------------------------------

    def write_times(self, primary_seconds: float | None = None) -> dict[str, float]:
        """Estimated seconds from ``save()`` to durable in each tier (measured tiers only)."""
        if not self.replicated:
            return {}
        if primary_seconds is not None:
            self._primary_seconds = primary_seconds
        base = self._primary_seconds
        times: dict[str, float] = {}
        if base is not None:
            times[self.primary_name] = base
        for name, replicator in self._replicators.items():
            seconds = replicator.write_seconds()
            if seconds is not None:
                times[name] = (base or 0.0) + seconds
        return times

    def _committed(self) -> dict[str, tuple[int, ...]]:
        assert self.primary is not None
        committed = {self.primary_name: tuple(self.primary.committed_versions())}
        committed.update({n: r.committed() for n, r in self._replicators.items()})
        return committed

    def place(
        self, version: int, step: int, notice: Notice | None, then: str = ""
    ) -> PlacementDecision:
        """The placement's decision for ``version`` now (calls to it serialized).

        Raises:
            PolicyError: the placement raised or answered something the engine cannot
                follow (:func:`~pcframe.policies.placement.base.checked_placement`); ``then``
                says in the message what that failure means to the caller.
        """
        assert self.placement is not None
        ctx = PlacementContext(
            version, step, time.monotonic(), self.write_times(), self._committed(), notice
        )
        return self._ask(ctx, then)

    def _ask(self, ctx: PlacementContext, then: str) -> PlacementDecision:
        assert self.placement is not None
        names = self._names or tuple(self.placement.tiers)
        with self._lock:  # placement policies are not required to be thread-safe
            return ask_placement(self.placement, ctx, names, then)

    def _keep(self, name: str, job: Job, listed: tuple[int, ...]) -> set[int]:
        """What tier ``name`` keeps now that ``job`` is written, from its real listing (the
        placement's view at commit time may be stale by then: a copy takes a while).

        A placement that fails here keeps every version the tier lists (nothing is deleted
        without its answer); its :class:`PolicyError` is raised by the engine's next call.
        """
        assert self.placement is not None
        committed = self._committed()
        committed[name] = listed
        ctx = PlacementContext(job.version, job.step, time.monotonic(), {}, committed, None)
        held = self._held.get(name, set())
        try:
            decision = self._ask(
                ctx,
                f"tier {name!r} deleted none of its versions (its retention after version "
                f"{job.version} needs that answer)",
            )
        except PolicyError as exc:
            self._failed(job.version, exc)
            return set(listed) | {job.version} | held
        return set(decision.keep.get(name, ())) | {job.version} | held

    def _failed(self, version: int, exc: PolicyError) -> None:
        """A background call of the placement failed: kept for the engine to raise; logged
        instead while an earlier one waits to be raised (a broken policy fails at every
        commit: one exception at a time, not a chain of them at the next calls)."""
        with self._failure_lock:
            waiting = self._failure
            if waiting is None:
                self._failure = (version, exc)
                return
        log.error("%s (logged: the failure about version %d is raised first)", exc, waiting[0])

    def take_failure(
        self, reported: Callable[[int], bool] = lambda version: True
    ) -> PolicyError | None:
        """The placement's failure not raised yet, taken (so raised once), if ``reported``
        says the engine has reported its version (that commit is counted first)."""
        with self._failure_lock:
            if self._failure is None or not reported(self._failure[0]):
                return None
            exc, self._failure = self._failure[1], None
            return exc

    def follow(self, pipeline: SavePipeline) -> None:
        """Serve the engine's save ``pipeline``: each commit is routed to the tiers
        (:meth:`on_commit`), its retention keeps what they need (:meth:`keep`), and while
        versions are replicated none is a delta (replicas copy single versions)."""
        pipeline.commit_listeners.append(self.on_commit)
        pipeline.retention.add(KeepWhere("tiers", self.keep))
        if self.replicated:
            pipeline.opener.delta_blockers.append("storage tiers")

    def on_commit(self, version: int, path: Path, manifest: Any) -> None:
        """Commit listener (engine's commit thread): route the version; never blocks."""
        del path
        if not self.replicated:
            return
        if getattr(manifest, "delta", None) is not None:
            # A delta version is only readable next to its base chain, which replicas do not
            # manage yet: they take self-contained (full) versions only.
            self._delta_versions.add(version)
            log.info("version %d is a delta version: not replicated", version)
            return
        try:
            decision = self.place(version, manifest.step, None, self._not_placed(version))
        except PolicyError as exc:  # the version stands in the primary: raised by the engine
            self._failed(version, exc)
            return
        self._primary_keep = set(decision.keep.get(self.primary_name, ()))
        for name in decision.tiers:
            if name != self.primary_name and name not in self.external:
                self._replicators[name].submit(Job(version, manifest.step))

    def _not_placed(self, version: int) -> str:
        """What a failed placement of a committed ``version`` means, for its error."""
        assert self.primary is not None
        others = sorted(self._replicators)
        if others:
            where = f"was not copied to tier(s) {others}, whose versions are intact"
        else:
            where = "went to no other tier"
        return (
            f"version {version} is committed in the primary tier {self.primary_name!r} "
            f"({self.primary.root}) and {where}"
        )

    def _not_secured(self, version: int) -> str:
        """What a failed placement at a preemption notice means, for its error."""
        assert self.primary is not None
        return (
            f"emergency version {version} is committed in the primary tier "
            f"{self.primary_name!r} ({self.primary.root}) and was not secured in another tier"
        )

    def hold(self, name: str, versions: Collection[int]) -> None:
        """Keep ``versions`` in replica tier ``name`` whatever the placement's retention says
        (replacing what was held there before): the newest version a multi-rank job has
        whole in its object store, which no rank may delete alone."""
        with self._lock:
            self._held[name] = set(versions)

    def remote(self) -> tuple[str, list[int]] | None:
        """The (first) non-local replica's name and its versions as last listed (no call),
        or ``None`` without one; once closed, as they were when its uploads ended."""
        for name, replicator in self._replicators.items():
            if not replicator.tier.local:
                return name, sorted(replicator.committed())
        return self._closed_remote

    def keep(self, committed: Sequence[int]) -> set[int]:
        """Retention reason: the primary keeps what the placement keeps for it and what
        replicas still have to copy."""
        del committed
        protect = set(self._primary_keep)
        for replicator in self._replicators.values():
            protect |= replicator.protected()
        return protect

    def secure(self, version: int, step: int, notice: Notice | None) -> Secured | None:
        """Make ``version`` durable in the tier the placement picks for a preemption notice.

        The primary already holds it; for other tiers this expedites the copy (aborting an
        older one in progress) and waits until it is written or the notice's deadline passes.
        ``None`` without tiers (the primary is the only place).
        """
        if not self.replicated:
            return None
        now = time.monotonic()
        asked = notice or Notice(now, now + self.secure_timeout)
        decision = self.place(version, step, asked, self._not_secured(version))
        targets = [t for t in decision.tiers if t != self.primary_name and t not in self.external]
        if not targets:
            # The placement chose a tier its caller secures (a multi-rank job's peers): that
            # caller judges whether the version outlives the VM.
            if self.survives(self.primary_name) or self.external & set(decision.tiers):
                return Secured(version, (self.primary_name,), True, decision.reason)
            return Secured(version, (self.primary_name,), False, self._lost_with_the_vm(decision))
        if version in self._delta_versions:
            reason = "a delta version cannot be replicated; save full versions on a notice"
            log.error("emergency version %d: %s", version, reason)
            return Secured(version, (self.primary_name,), False, reason)
        deadline = notice.deadline if notice is not None else now + self.secure_timeout
        for name in targets:
            self._replicators[name].expedite(Job(version, step))
        durable = all(
            self._replicators[name].wait_for(version, bounded_wait(deadline - time.monotonic()))
            for name in targets
        )
        if not durable:
            log.error(
                "emergency version %d did not reach tier(s) %s before the deadline "
                "(%s); the newest version there is what a restart will find",
                version,
                targets,
                decision.reason,
            )
        if durable and not any(self.survives(name) for name in targets):
            return Secured(version, tuple(targets), False, self._lost_with_the_vm(decision))
        return Secured(version, tuple(targets), durable, decision.reason)

    def survives(self, name: str) -> bool:
        """Whether a version in tier ``name`` outlives the VM: as the placement's rule says
        (``TierRule.survives_preemption``; the default rules say so of every tier that is not
        RAM-backed, and a rule that contradicts its tmpfs folder is warned about at open);
        without a rule, unless the tier is on a RAM-backed folder."""
        rule = next((r for r in getattr(self.placement, "rules", ()) if r.name == name), None)
        if rule is not None:
            return rule.survives_preemption
        if name == self.primary_name:
            return self.primary is None or not is_memory_backed(self.primary.root)
        return not _ram_backed(self.replicas.get(name))

    def _lost_with_the_vm(self, decision: PlacementDecision) -> str:
        log.error(
            "preemption notice: no tier this version went to outlives the VM (%s): add a "
            "disk that survives preemption or an object store to tiers=",
            decision.reason,
        )
        return f"{decision.reason}; no tier it went to outlives the VM"

    # --- restore -------------------------------------------------------------------------

    def sources(self, version: int | None = None) -> tuple[list[Source], list[str]]:
        """Where a restore may read from, newest version first; plus tiers that could not be
        listed (each as 'name: reason'). See :func:`tier_sources`."""
        assert self.primary is not None
        return tier_sources(self.primary, self.primary_name, self._ordered(), version)

    def committed(self) -> dict[str, tuple[int, ...]]:
        """Versions per tier as last known (replicas: cached, no listing call)."""
        return self._committed()

    # --- status and shutdown -------------------------------------------------------------

    def status(self) -> dict[str, TierStatus]:
        return {name: r.status() for name, r in self._replicators.items()}

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every replica has written everything submitted (for tests, benchmarks)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for replicator in self._replicators.values():
            while True:
                s = replicator.status()
                if s.pending is None and s.in_flight is None:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
        return True

    def close(self, hurry: bool = False) -> None:
        """Let replicas finish queued versions (up to ``drain_timeout`` s in all), then stop.

        ``hurry``: abort at once (the machine is being preempted and :meth:`secure` already
        put the emergency version where it survives; older copies are not worth the wait).
        """
        for replicator in self._replicators.values():
            replicator.begin_close()
        waited = 0.0 if hurry else self.drain_timeout
        deadline = time.monotonic() + waited
        for name, replicator in self._replicators.items():
            if not replicator.finish_close(max(0.0, deadline - time.monotonic())):
                log.warning(
                    "tier %s: replication still running after %.0f s at close%s; "
                    "aborted (status: %s)",
                    name,
                    waited,
                    " (in a hurry: preempted or never started)" if hurry else "",
                    replicator.status(),
                )
        self._closed_remote = self.remote()
        self._replicators.clear()
        self._close_tiers()

    def _close_tiers(self) -> None:
        for tier in self.replicas.values():
            with contextlib.suppress(Exception):
                tier.close()


def attach_tiers(
    tiers: Tiers | Mapping[str, TierSpec] | None,
    placement: PlacementPolicy | None,
    primary: WritableCheckpointDir,
    keep_last: int,
) -> tuple[Tiers, int]:
    """The engine's tiers (the null object without replicas or placement), attached.

    Returns them and the newest version any replica holds (0 if none).

    Raises:
        TypeError: ``placement`` is a class or a name, not a placement policy object (it
            failed at the first commit, as "'property' object is not subscriptable").
    """
    # A class or a name failed at the first commit ("'property' object is not subscriptable").
    require_object("placement", placement, "place", "a placement policy", "SingleTier()")
    if tiers is None and placement is None:
        tiers = Tiers.primary_only()
    elif not isinstance(tiers, Tiers):
        tiers = Tiers(tiers or {}, placement)
    elif placement is not None:
        tiers.placement = placement
    try:
        newest = tiers.attach(primary, keep_last)
    except BaseException:
        tiers.close()
        raise
    return tiers, newest


def _ram_backed(tier: Tier | None) -> bool:
    """A local tier on tmpfs / ramfs (gone with the VM, whatever a rule says)."""
    return isinstance(tier, LocalTier) and is_memory_backed(tier.path)
