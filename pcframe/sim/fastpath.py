"""The fast paths of :class:`~pcframe.sim.process.Process`, in a mixin of their own.

* ``_periodic``: a policy whose hint says ``every=k`` has its saves up to the next event
  computed by the Numba kernel in one call.
* ``_steady``: the steady-state fast-forward. Once the last three saves of any policy were
  k steps apart with equal stalls and its hint points k steps ahead again, the saves up to
  the next event or ``probe_gap`` are computed by the kernel, their ``SaveCompleted``
  events are delivered, and the policy is asked at the last one. It must say save and point
  k steps ahead again; otherwise process and policy are rolled back (``_snapshot`` /
  ``_restore``, the policy through ``load_state_dict``) and the stretch is re-run exactly.
  Where the policy could change its mind and back inside a stretch (backpressure building,
  estimates still moving, a tie at the clock's last bits) no stretch starts; a kill whose
  checkpoint was made inside one re-runs it first (``_replay``), so the restart gets the
  policy state the engine would have saved.

The arithmetic of a save is the kernel's (:mod:`pcframe.sim.kernel`), the same as
``Process._save``; tests run both on the same schedules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from pcframe.policies.base import SaveHint, checked_hint
from pcframe.sim.kernel import periodic_saves
from pcframe.sim.state import Flight, by_durable, measured, save_cost, saved_state

NO_LIMIT = np.iinfo(np.int64).max
_EXACT_BITS = 20  # times that are multiples of 2**-20 s add and subtract exactly (< 2**32 s)
_EMPTY = np.zeros((0, 4))


class Stretch(NamedTuple):
    """A fast-forwarded stretch that may still hold the checkpoint a kill keeps."""

    first: int  # its first version
    end: int  # one past its last version
    snapshot: _Snapshot  # process and policy before it
    fast_forwards: int  # the ledger's count before it


class FastPaths:
    """Mixed into ``Process``; uses its state (steps, segments, in-flight saves, policy)."""

    # Provided by Process (declared for readers and type checkers).
    policy: Any
    job: Any
    ledger: Any
    commit: Any
    versions: Any
    inflight: list[Flight]
    _stretches: list[Stretch]
    placements: Any  # pcframe.sim.tiers.Placements | None
    life: int

    # --- the kernel ---------------------------------------------------------------------------
    def _kernel(
        self, first: int, every: int, limit: float, max_saves: int, out: np.ndarray
    ) -> tuple:
        """Run the kernel from the current state (the in-flight list is copied in)."""
        n_max = self.job.max_in_flight
        durable = np.zeros(n_max + 1)
        steps = np.zeros(n_max + 1, dtype=np.int64)
        live = [f for f in self.inflight if f.durable_at > self.t]
        live.sort(key=by_durable)
        for i, f in enumerate(live):
            durable[i], steps[i] = f.durable_at, f.step
        last = max((f.durable_at for f in self.inflight), default=-math.inf)
        result = periodic_saves(
            self.seg_t0,
            self.seg_step0,
            self.step,
            first,
            every,
            self.it,
            self.job.save_stall,
            self.job.save_duration,
            self.job.persist == "serial",
            n_max,
            durable,
            steps,
            len(live),
            last,
            limit,
            min(self.total - 1, NO_LIMIT),
            max_saves,
            out,
        )
        return result, durable, steps

    def _limit(self, t_stop: float) -> float:
        return t_stop if self.t >= self.notice_at else min(t_stop, self.notice_at)

    def _place_rows(self, rows: list[list[float]], v0: int, state: Any, limit: float) -> None:
        """Ask the placement about each of a run's saves (rows: step, start, durable,
        stall; versions from ``v0``), as the engine asks at every commit. The run stops
        at ``limit``, before any kill: no kill precedes ``min(start, limit)``."""
        for i, (s, start, durable, stall) in enumerate(rows):
            self.placements.place(
                v0 + i,
                int(s),
                start,
                durable,
                now=min(start, limit),
                notice=None,
                policy_state=state,
                cost=save_cost(stall, start, durable),
                life=self.life,
            )

    def _restorable_floor(self) -> int:
        """The oldest version a kill from now on can restore: the committed one, or with
        placements the newest in a tier that survives (a stretch may still hold it)."""
        if self.placements is None:
            return self.commit.version
        return self.placements.floor(self.t)

    def _periodic(self, hint: SaveHint, t_stop: float) -> None:
        """All saves of a periodic policy up to ``t_stop`` (or the notice), in the kernel."""
        every = int(hint.every)  # type: ignore[arg-type]
        first = self.step + 1 if hint.step is None else max(hint.step, self.step + 1)
        limit = self._limit(t_stop)
        if first >= self.total or self.time_of(first) > limit:
            return
        self._commit_durable(self.t, report=False)
        live = {f.step: f for f in self.inflight}
        (seg_t0, seg_step0, step, saves, stall, n_fl, c_step, c_at, _), durable, steps = (
            self._kernel(first, every, limit, NO_LIMIT, _EMPTY)
        )
        if saves == 0:
            return
        # A periodic policy's state does not change between saves: one snapshot serves all.
        state = saved_state(self.policy)
        if self.placements is not None:
            # Every save is placed on its own (the same run again, recording each save).
            rows = np.empty((saves, 4))
            self._kernel(first, every, limit, saves, rows)
            self._place_rows(rows.tolist(), self.versions.next, state, limit)
        v0 = self.versions.take(saves)

        def version(s: int) -> int:
            return live[s].version if s in live else v0 + (s - first) // every

        duration, stall_one = self.job.save_duration, self.job.save_stall
        if c_step >= 0 and c_step > self.commit.step:
            s = int(c_step)
            # What the engine would record: a save from before the run as measured, one of
            # the run as its in-flight entries below are measured.
            cost = measured(live[s]) if s in live else save_cost(stall_one, 0.0, duration)
            self._set_commit(s, version(s), float(c_at), state, cost)
        self.inflight = [
            live.get(int(s)) or Flight(version(int(s)), int(s), d - duration, d, stall_one, state)
            for s, d in zip(steps[:n_fl].tolist(), durable[:n_fl].tolist(), strict=True)
        ]
        self.seg_t0, self.seg_step0, self.step = seg_t0, int(seg_step0), int(step)
        self.t = self.time_of(self.step)
        self.stall += stall
        # A periodic run saves at first, first + every, ... (backpressure only stalls).
        self.ledger.saved(range(first, first + saves * every, every))
        self.feed.last_save_step, self.feed.last_save_time = int(seg_step0), seg_t0
        # What the engine's EWMAs read after these saves (every sample the same, mostly).
        self.feed.save_stall = (
            self.feed.save_stall if self.feed.save_stall is not None else stall_one
        )
        self.feed.save_duration = duration
        self.hint = checked_hint(self.policy, self.policy.save_hint(self._ctx(self.t)))

    # --- steady-state fast-forward ------------------------------------------------------------
    def _steady_gap(self) -> int:
        """k if the last three saves were k steps apart with equal stalls, the policy planned
        the same time ahead after each, and its next point is k steps ahead again; else 0.

        The plan ahead is the policy's own estimate at work (its interval): the engine's
        running means may have settled while a policy that smooths more slowly, or carries
        samples from an earlier process, is still moving towards them (Daly with
        ``alpha=0.1`` crossed the gap of serial writes inside a stretch)."""
        if len(self._saves) < 3 or self.hint is None or self.hint.every is not None:
            return 0
        (s0, _st0, a0), (s1, st1, a1), (s2, st2, a2) = self._saves
        k = s2 - s1
        if k < 1 or s1 - s0 != k or not _close(st1, st2):
            return 0
        if not (_same_plan(a0, a1, self.t) and _same_plan(a1, a2, self.t)):
            return 0
        return k if self._hinted_step() == s2 + k else 0

    def _on_rounding_edge(self, step: int, rows: list[list[float]]) -> bool:
        """Whether the policy's answer at the stretch's saves may turn on rounding.

        That is when the hinted time lies within rounding of the end of ``step`` (or of the
        step before) and the times are not exact binary fractions. Daly's interval at its
        concurrency floor, duration / n, equals the gap that serial writes enforce: asked at
        every step, the policy compares ``now - anchor`` with it, whose last bits follow the
        magnitude of the clock and its own estimate's convergence, and flips now and then; a
        stretch asked at its end would not see it. With exact times (whole-second steps and
        stalls) every comparison comes out the same, and the end check is enough."""
        when = self.hint.time if self.hint is not None else None
        if when is None:
            return False
        if not any(_close(self.time_of(s), when) for s in (step - 1, step)):
            return False
        stall = self.job.save_stall
        times = [when] + [start + stall - waited for _, start, _, waited in rows]
        return not all(math.ldexp(t, _EXACT_BITS).is_integer() for t in times)

    def _hinted_step(self) -> int:
        hint = self.hint
        assert hint is not None
        if hint.time is not None and math.isinf(hint.time):
            return -1
        s = self.step + 1 if hint.step is None else max(hint.step, self.step + 1)
        if hint.time is not None:
            s = max(s, self._first_step_at(hint.time))
        return s

    def _steady(self, t_stop: float) -> bool:
        """Fast-forward a steady policy; ``True`` if it advanced (a real decide included)."""
        k = self._ff_every  # stays set when there is no room now: the next call goes on
        limit = min(self._limit(t_stop), self.last_decide + self.probe_gap)
        first = (self.feed.last_save_step or 0) + k
        if first <= self.step or first >= self.total or self.time_of(first) > limit:
            return False
        # How many saves fit; the last one is made through a real decide.
        fits = self._kernel(first, k, limit, NO_LIMIT, _EMPTY)[0][3]
        if fits < 3:
            return False
        n = fits - 1
        out = np.empty((n, 4))
        self._kernel(first, k, limit, n, out)
        rows = out.tolist()
        if (
            not _unchanging(rows, self._saves[-1][1])
            or not self._settled(rows[0])
            or self._on_rounding_edge(first, rows)
        ):
            # Backpressure is building (a slot wait, a queue of serial writes): the policy
            # learns longer saves as they complete and may space them out, which asking it
            # only at the stretch's end would not see. Go step by step until it settles.
            self._ff_every = 0
            self._ff_blocked_until = rows[-1][1]
            return False
        snapshot = self._snapshot()
        state = saved_state(self.policy)
        if self.placements is not None:
            self._place_rows(rows, self.versions.next, state, limit)
        v0 = self.versions.take(n)
        for i, (s, start, durable, stall) in enumerate(rows):
            self.inflight.append(Flight(v0 + i, int(s), start, durable, stall, state))
        last_step, last_start = int(rows[-1][0]), rows[-1][1]
        self.seg_t0 = last_start + self.job.save_stall
        self.seg_step0 = last_step
        self.stall += sum(r[3] for r in rows)
        self.ledger.saved([int(r[0]) for r in rows])
        self.feed.last_save_step, self.feed.last_save_time = last_step, self.seg_t0
        self.step = last_step
        self.t = self.seg_t0
        ahead = self._saves[-1][2]  # the plan the stretch assumes at each of its saves
        self._saves = [(int(r[0]), r[3], ahead) for r in rows[-3:]]
        target = last_step + k
        self._advance(target)
        self._decide()
        if self.feed.last_save_step == target and self._ff_every == k:
            self.ledger.fast_forwards += 1
            kept = [r for r in self._stretches if r.end > self._restorable_floor()]
            done = self.ledger.fast_forwards - 1
            self._stretches = [*kept, Stretch(v0, v0 + n, snapshot, done)]
            return True
        failed_at = self.t
        self._restore(snapshot)
        self._ff_blocked_until = failed_at
        self.ledger.rollbacks += 1
        return False

    def _settled(self, row: list[float]) -> bool:
        """Whether the engine's running means of the stall and the time to durable are
        already at the stretch's values. While they still move, so may a policy's estimates
        (CheckFreq's k went 13, 12, then 13 again as its time to durable came down to the
        stretch's 40 s), and the check at the stretch's end would not see the change."""
        stall, duration = self.feed.save_stall, self.feed.save_duration
        if stall is None or duration is None:
            return False
        return _close(stall, row[3]) and _close(duration, row[2] - row[1])

    def _replay(self, at: float) -> None:
        """Before a kill at ``at``: if the checkpoint it keeps was made in a stretch, run
        that stretch again step by step.

        A stretch's saves hold the policy state of its start: it was asked only at the end,
        where the engine would have asked it at every save and reported every completion on
        the way (what CheckFreq's cost estimates and the overhead budget's ledger learn). A
        restart from such a save must get what the policy knew then, so the stretch is
        re-run from its snapshot, without fast-forwarding, up to the kill."""
        if self.placements is not None:
            survivor = self.placements.survivor(at)
            kept = 0 if survivor is None else survivor.version
        else:
            newest = max(
                (f for f in self.inflight if f.durable_at <= at),
                key=lambda f: f.step,
                default=None,
            )
            kept = (
                newest.version if newest and newest.step > self.commit.step else self.commit.version
            )
        for stretch in self._stretches:
            if stretch.first <= kept < stretch.end:
                self._stretches = []
                self._restore(stretch.snapshot)
                self.ledger.fast_forwards = stretch.fast_forwards
                self.fast_forward, was = False, self.fast_forward
                try:
                    self.run_until(at)
                finally:
                    self.fast_forward = was
                return

    def _snapshot(self) -> _Snapshot:
        led, commit = self.ledger, self.commit
        return _Snapshot(
            own={name: getattr(self, name) for name in _OWN},
            feed={name: getattr(self.feed, name) for name in _FEED},
            policy_state=saved_state(self.policy),
            inflight=list(self.inflight),
            saves=list(self._saves),
            commit=(commit.step, commit.version, commit.time, commit.policy_state, commit.cost),
            counts=(led.saves, led.decisions, led.emergency_saves),
            next_version=self.versions.next,
            placements=None if self.placements is None else self.placements.snapshot(),
        )

    def _restore(self, snap: _Snapshot) -> None:
        for name, value in snap.own.items():
            setattr(self, name, value)
        for name, value in snap.feed.items():
            setattr(self.feed, name, value)
        self.policy.load_state_dict(snap.policy_state)  # the snapshot's own copy, used once
        self.inflight, self._saves = snap.inflight, snap.saves
        self._set_commit(*snap.commit)
        saves, self.ledger.decisions, self.ledger.emergency_saves = snap.counts
        self.ledger.set_saves(saves)
        self.versions.next = snap.next_version
        if snap.placements is not None:
            self.placements.restore(snap.placements)
        self._ff_every = 0


# What a stretch's snapshot keeps of the process (plain values) and of its feed.
_OWN = ("seg_t0", "seg_step0", "step", "t", "stall", "last_decide", "hint")
_FEED = ("save_stall", "save_duration", "last_save_step", "last_save_time")


@dataclass(frozen=True)
class _Snapshot:
    """A process as it stood when a fast-forward stretch began (to go back to)."""

    own: dict[str, Any]
    feed: dict[str, Any]
    policy_state: Any
    inflight: list[Any]
    saves: list[Any]
    commit: tuple[Any, ...]
    counts: tuple[int, int, int]
    next_version: int
    placements: Any = None  # the placements' own snapshot, when they are modelled


def _unchanging(rows: list[list[float]], last_stall: float) -> bool:
    """Every fast-forwarded save has the last save's stall and one time to durable, so the
    policy learns nothing new in the stretch (rows: step, start, durable, stall)."""
    stalls = [last_stall] + [row[3] for row in rows]
    durations = [row[2] - row[1] for row in rows]
    tolerance = 1e-9 * max(1.0, max(durations))
    return max(stalls) - min(stalls) <= tolerance and max(durations) - min(durations) <= tolerance


def _close(a: float, b: float) -> bool:
    """Equal but for rounding: within 1e-9 of ``b`` (relative, absolute below 1)."""
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def _same_plan(a: float | None, b: float | None, now: float) -> bool:
    """Two saves' plans ahead equal but for the rounding of times near ``now``."""
    if a is None or b is None:
        return a is b
    return abs(a - b) <= 4.0 * math.ulp(max(abs(now), 1.0))
