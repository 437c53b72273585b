"""The fast paths of :class:`~pcframe.sim.process.Process`, in a mixin of their own.

* ``_periodic``: a policy whose hint says ``every=k`` has its saves up to the next event
  computed by the Numba kernel in one call.
* ``_steady``: the steady-state fast-forward. Once the last three saves of any policy were
  k steps apart with equal stalls and its hint points k steps ahead again, the saves up to
  the next event or ``probe_gap`` are computed by the kernel, their ``SaveCompleted``
  events are delivered, and the policy is asked at the last one. It must say save and point
  k steps ahead again; otherwise process and policy are rolled back (``_snapshot`` /
  ``_restore``, the policy through ``load_state_dict``) and the stretch is re-run exactly.

The arithmetic of a save is the kernel's (:mod:`pcframe.sim.kernel`), the same as
``Process._save``; tests run both on the same schedules.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pcframe.policies.base import SaveHint, checked_hint
from pcframe.sim.kernel import periodic_saves
from pcframe.sim.state import Flight, by_durable, saved_state

NO_LIMIT = np.iinfo(np.int64).max
_EMPTY = np.zeros((0, 4))


class FastPaths:
    """Mixed into ``Process``; uses its state (steps, segments, in-flight saves, policy)."""

    # Provided by Process (declared for readers and type checkers).
    policy: Any
    job: Any
    ledger: Any
    commit: Any
    versions: Any
    inflight: list[Flight]

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
        v0 = self.versions.take(saves)

        def version(s: int) -> int:
            return live[s].version if s in live else v0 + (s - first) // every

        if c_step >= 0 and c_step > self.commit.step:
            self._set_commit(int(c_step), version(int(c_step)), float(c_at), state)
        duration, stall_one = self.job.save_duration, self.job.save_stall
        self.inflight = [
            live.get(int(s)) or Flight(version(int(s)), int(s), d - duration, d, stall_one, state)
            for s, d in zip(steps[:n_fl].tolist(), durable[:n_fl].tolist(), strict=True)
        ]
        self.seg_t0, self.seg_step0, self.step = seg_t0, int(seg_step0), int(step)
        self.t = self.time_of(self.step)
        self.stall += stall
        self.ledger.saves += saves
        self.feed.last_save_step, self.feed.last_save_time = int(seg_step0), seg_t0
        # What the engine's EWMAs read after these saves (every sample the same, mostly).
        self.feed.save_stall = (
            self.feed.save_stall if self.feed.save_stall is not None else stall_one
        )
        self.feed.save_duration = duration
        self.hint = checked_hint(self.policy, self.policy.save_hint(self._ctx(self.t)))

    # --- steady-state fast-forward ------------------------------------------------------------
    def _steady_gap(self) -> int:
        """k if the last three saves were k steps apart with equal stalls and the policy's
        next point is k steps ahead again; else 0."""
        if len(self._saves) < 3 or self.hint is None or self.hint.every is not None:
            return 0
        (s0, _st0), (s1, st1), (s2, st2) = self._saves
        k = s2 - s1
        if k < 1 or s1 - s0 != k or abs(st1 - st2) > 1e-9 * max(st2, 1.0):
            return 0
        return k if self._hinted_step() == s2 + k else 0

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
        if not _unchanging(rows, self._saves[-1][1]):
            # Backpressure is building (a slot wait, a queue of serial writes): the policy
            # learns longer saves as they complete and may space them out, which asking it
            # only at the stretch's end would not see. Go step by step until it settles.
            self._ff_every = 0
            self._ff_blocked_until = rows[-1][1]
            return False
        snapshot = self._snapshot()
        state = saved_state(self.policy)
        v0 = self.versions.take(n)
        for i, (s, start, durable, stall) in enumerate(rows):
            self.inflight.append(Flight(v0 + i, int(s), start, durable, stall, state))
        last_step, last_start = int(rows[-1][0]), rows[-1][1]
        self.seg_t0 = last_start + self.job.save_stall
        self.seg_step0 = last_step
        self.stall += sum(r[3] for r in rows)
        self.ledger.saves += n
        self.feed.last_save_step, self.feed.last_save_time = last_step, self.seg_t0
        self.step = last_step
        self.t = self.seg_t0
        self._saves = [(int(r[0]), r[3]) for r in rows[-3:]]
        target = last_step + k
        self._advance(target)
        self._decide()
        if self.feed.last_save_step == target and self._ff_every == k:
            self.ledger.fast_forwards += 1
            return True
        failed_at = self.t
        self._restore(snapshot)
        self._ff_blocked_until = failed_at
        self.ledger.rollbacks += 1
        return False

    def _snapshot(self) -> tuple:
        led = self.ledger
        return (
            saved_state(self.policy),
            self.seg_t0,
            self.seg_step0,
            self.step,
            self.t,
            list(self.inflight),
            (self.commit.step, self.commit.version, self.commit.time, self.commit.policy_state),
            self.stall,
            self.feed.save_stall,
            self.feed.save_duration,
            self.feed.last_save_step,
            self.feed.last_save_time,
            self.last_decide,
            self.hint,
            list(self._saves),
            self.versions.next,
            (led.saves, led.decisions, led.emergency_saves),
        )

    def _restore(self, snap: tuple) -> None:
        (
            state,
            self.seg_t0,
            self.seg_step0,
            self.step,
            self.t,
            self.inflight,
            commit,
            self.stall,
            self.feed.save_stall,
            self.feed.save_duration,
            self.feed.last_save_step,
            self.feed.last_save_time,
            self.last_decide,
            self.hint,
            self._saves,
            self.versions.next,
            counts,
        ) = snap
        self.policy.load_state_dict(state)  # the snapshot's own copy, used once
        self._set_commit(*commit)
        self.ledger.saves, self.ledger.decisions, self.ledger.emergency_saves = counts
        self._ff_every = 0


def _unchanging(rows: list[list[float]], last_stall: float) -> bool:
    """Every fast-forwarded save has the last save's stall and one time to durable, so the
    policy learns nothing new in the stretch (rows: step, start, durable, stall)."""
    stalls = [last_stall] + [row[3] for row in rows]
    durations = [row[2] - row[1] for row in rows]
    tolerance = 1e-9 * max(1.0, max(durations))
    return max(stalls) - min(stalls) <= tolerance and max(durations) - min(durations) <= tolerance
