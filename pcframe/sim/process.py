"""One training process between two (re)starts, driving the real interval policy.

The end of step ``s`` is at ``seg_t0 + (s - seg_step0) * it``: steps run back to back and
every save starts a new segment after its stall. The process never iterates over steps: it
asks the policy at candidate points only and jumps whole steps in between. Candidate points
are where the policy's :meth:`save_hint` says it may save, the first step after a save
became durable (the engine reports ``SaveCompleted`` at its next call, and what the policy
learns may move its plan), the arrival of a notice, and at least every ``probe_gap``
seconds. ``use_hints=False`` asks at every step instead: the slow reference.

Runs of evenly spaced saves go to the Numba kernel instead (:mod:`pcframe.sim.fastpath`):
all saves of a periodic policy, and the verified steady-state fast-forward of any other.

What the policy sees is what the engine would give it, built by the same
:class:`~pcframe.feed.PolicyFeed`: ``PolicyContext`` with the sim clock as ``now``, the
iteration time, the stall and time-to-durable EWMAs measured in this process (``None`` until
a save of this process completed), a ``Notice`` when the trace's preemption is
``notice_window`` ahead, and after a restart the policy state stored in the checkpoint that
was restored, then ``Restarted``.

With a placement policy (:mod:`pcframe.sim.tiers`) every save is also placed, and a kill or
a planned stop keeps only what a tier outliving the VMs holds (``_lose_vms``).
"""

from __future__ import annotations

import math
from typing import Any

from pcframe.feed import PolicyFeed
from pcframe.policies.base import (
    IntervalPolicy,
    Notice,
    PolicyContext,
    SaveCompleted,
    SaveHint,
    checked_decision,
    checked_hint,
)
from pcframe.sim.fastpath import NO_LIMIT, FastPaths, Stretch
from pcframe.sim.spec import JobSpec, SimOptions
from pcframe.sim.state import (
    Commit,
    Flight,
    Ledger,
    SaveCost,
    Versions,
    by_durable,
    measured,
    saved_state,
)
from pcframe.sim.tiers import Placements

__all__ = ["SURVIVOR_TIER", "Commit", "Flight", "Ledger", "Process", "Versions"]

SURVIVOR_TIER = "survivor"  # the tier name notice-driven saves go to (JobSpec.survivor_...)
# Steps whose end times floats still tell apart one by one (2**53: a double's whole numbers).
_EXACT_STEPS = 2**53


class Process(FastPaths):
    """A training process started at ``start``, training from ``commit.step`` on."""

    def __init__(
        self,
        *,
        policy: IntervalPolicy,
        job: JobSpec,
        options: SimOptions,
        ledger: Ledger,
        commit: Commit,
        versions: Versions,
        start: float,
        step_time: float,
        notice: Notice | None,
        preemption_rate: float | None = None,
        unix0: float | None = None,
        life: int = 0,
        restart_cost: float | None = None,
        placements: Placements | None = None,
    ) -> None:
        self.policy = policy
        # Where each version goes and what survives a preemption (None: every durable
        # version survives, the one-tier model).
        self.placements = placements
        self.life = life  # this process's index among the job's starts
        self.job = job
        self.ledger = ledger
        self.commit = commit
        self.versions = versions
        self.use_hints = options.use_hints
        # A stretch asks only at its end: not for a policy that must be asked at the points
        # its hints name (re-predictions on its own clock), or it drifts from the engine.
        self.fast_forward = (
            options.use_hints
            and options.fast_forward
            and not getattr(policy, "changes_with_clock", False)
        )
        self.probe_gap = options.probe_gap
        self.rate = preemption_rate
        self.unix0 = unix0
        self.start = start
        # This start's restart time (drawn around job.restart_cost when it has jitter).
        self.restart_cost = job.restart_cost if restart_cost is None else restart_cost
        self.ready = start + self.restart_cost
        self.it = step_time
        self.step0 = commit.step
        self.step = commit.step
        self.seg_t0 = self.ready
        self.seg_step0 = commit.step
        self.t = self.ready  # the training thread is free from here
        self.total = job.total_steps if job.total_steps is not None else NO_LIMIT
        self.notice = notice
        self.notice_at = notice.received_at if notice is not None else math.inf
        self.inflight: list[Flight] = []
        survivor = job.survivor_tier_duration
        # The engine's estimate per tier; the sim knows only the tier notices write to.
        self.tiers = None if survivor is None else {SURVIVOR_TIER: survivor}
        self.stall = 0.0
        # The iteration time is the job's, not measured: the feed takes no samples of it.
        self.feed = PolicyFeed(iteration_time=step_time)
        self.restored = commit.version > 0
        if self.restored:
            self.feed.resumed(commit.step, self.restart_cost)
        self.last_decide = self.ready
        self.hint: SaveHint | None = None
        self.finished = False
        self.ended = False
        self._asked = False
        # Events for the policy at the first decision: the restore happens when training is
        # ready again, and a process killed while starting never delivers them.
        self.pending_events: list[Any] = []
        # (step, stall, the hint's time - the decision's) of the last real saves
        self._saves: list[tuple[int, float, float | None]] = []
        self._ff_every = 0
        self._ff_blocked_until = -math.inf  # no new attempt inside a stretch that failed
        self._stretches: list[Stretch] = []  # see FastPaths._replay

    # --- time of steps ----------------------------------------------------------------------
    def time_of(self, step: int) -> float:
        return self.seg_t0 + (step - self.seg_step0) * self.it

    def _last_step_by(self, t: float) -> int:
        """The last step that has ended by ``t`` (at least the current one)."""
        if t < self.seg_t0:
            return self.step
        it, t0, s0 = self.it, self.seg_t0, self.seg_step0
        j = s0 + int((t - t0) // it)
        while t0 + (j + 1 - s0) * it <= t:
            j += 1
        while j > self.step and t0 + (j - s0) * it > t:
            j -= 1
        return max(j, self.step)

    def _first_step_at(self, t: float) -> int:
        """The first step after the current one that ends at or after ``t``."""
        it, t0, s0 = self.it, self.seg_t0, self.seg_step0
        if t <= t0 + (self.step + 1 - s0) * it:
            return self.step + 1
        ahead = (t - t0) / it
        if s0 + ahead > min(self.total, _EXACT_STEPS):
            # Past the job's end (an interval of 1e308 s): no step of it ends then, and
            # counting up to it step by step below never ended, as beyond 2**53 steps one more
            # step does not change the float time compared with ``t``. Such a time (past
            # 2**53 steps, more than 285 years of 1 us steps) is taken as past the end.
            # Within rounding of the last step's end this says total + 1 where the count
            # below said total: every caller takes both as "no step before the end".
            return self.total + 1 if self.total < NO_LIMIT else NO_LIMIT
        j = s0 + math.ceil(ahead)
        while j - 1 > self.step and t0 + (j - 1 - s0) * it >= t:
            j -= 1
        while t0 + (j - s0) * it < t:
            j += 1
        return j

    # --- the policy's view --------------------------------------------------------------------
    def _ctx(self, now: float) -> PolicyContext:
        in_flight = 0
        for f in self.inflight:
            if f.durable_at > now:
                in_flight += 1
        return self.feed.context(
            self.step,
            now,
            notice=self.notice if now >= self.notice_at else None,
            wall_time=None if self.unix0 is None else self.unix0 + now,
            in_flight=in_flight,
            max_in_flight=self.job.max_in_flight,
            preemption_rate=self.rate,
            tier_write_times=self.tiers,
        )

    # --- running ------------------------------------------------------------------------------
    def run_until(self, t_stop: float) -> None:
        """Train until ``t_stop`` (whole steps), asking the policy at candidate points."""
        while not self.finished:
            nxt = self._next_point(t_stop) if self._asked else self.step + 1
            fit = self._last_step_by(t_stop)
            if nxt is None or nxt > fit or nxt > self.total:
                self._advance(min(fit, self.total))
                if self.step >= self.total:
                    self._finish()
                return
            self._advance(nxt)
            if self.step >= self.total:
                self._finish()
                return
            self._decide()
            if self.t >= t_stop:
                return

    def _advance(self, step: int) -> None:
        if step > self.step:
            self.step = step
            self.t = self.seg_t0 + (step - self.seg_step0) * self.it

    def _next_point(self, t_stop: float) -> int | None:
        """The next step at which to ask the policy (``None``: not before ``t_stop``)."""
        hint = self.hint
        if hint is None or not self.use_hints:
            return self.step + 1
        if hint.every is not None:
            self._periodic(hint, t_stop)
            hint = self.hint
            if hint is None:
                return self.step + 1
        elif self._ff_every:
            while self._ff_every and not self.finished and self._steady(t_stop):
                pass
            if self.finished:
                return None
            hint = self.hint
            if hint is None:
                return self.step + 1
        best = NO_LIMIT
        if hint.time is None or hint.time != math.inf:
            s = self.step + 1 if hint.step is None else max(hint.step, self.step + 1)
            if hint.time is not None:
                s = max(s, self._first_step_at(hint.time))
            best = s
        if hint.every is None:
            if self.inflight:
                best = min(best, self._first_step_at(min(f.durable_at for f in self.inflight)))
            best = min(best, self._first_step_at(self.last_decide + self.probe_gap))
        if self.last_decide < self.notice_at < math.inf:
            # Arrived since the policy was last asked, stalls included: a notice that came
            # during a save's stall is asked about at the first step after it, as the
            # engine asks at every step (only a notice still ahead was a point before).
            best = min(best, self._first_step_at(self.notice_at))
        best = min(best, self.total)
        return None if best == NO_LIMIT else best

    def _decide(self) -> None:
        now = self.t
        if self.pending_events:
            for event in self.pending_events:
                self.policy.observe(event)
            self.pending_events = []
        self._commit_durable(now, report=True)
        ctx = self._ctx(now)
        decision = checked_decision(self.policy, self.policy.decide(ctx))
        self.ledger.decisions += 1
        self._asked = True
        self.last_decide = now
        stall = self._save(decision.emergency) if decision.save else 0.0
        self.hint = (
            checked_hint(self.policy, self.policy.save_hint(ctx)) if self.use_hints else None
        )
        if decision.save:
            when = None if self.hint is None else self.hint.time
            ahead = when - now if when is not None and math.isfinite(when) else None
            self._saves = [*self._saves[-2:], (self.step, stall, ahead)]
            if self.fast_forward and now >= self._ff_blocked_until:
                self._ff_every = self._steady_gap()

    def _save(self, emergency: bool) -> float:
        """Start a save at the current step; returns the stall it caused."""
        t = self.t
        start = t
        job = self.job
        busy = [f.durable_at for f in self.inflight if f.durable_at > t]
        if len(busy) >= job.max_in_flight:
            start = min(busy)  # backpressure: a slot frees when the oldest is durable
        last = max((f.durable_at for f in self.inflight), default=-math.inf)
        duration = job.save_duration
        if emergency and job.survivor_tier_duration is not None:
            # A notice's save goes to the fastest tier that survives the VM, by itself.
            duration, last = job.survivor_tier_duration, -math.inf
        serial = job.persist == "serial" and last > start
        durable = (last if serial else start) + duration
        end = start + job.save_stall
        if emergency:
            end = max(end, durable)  # the engine waits until the version is durable
            self.ledger.emergency_saves += 1
        state = saved_state(self.policy)
        version = self.versions.take()
        flight = Flight(version, self.step, start, durable, end - t, state)
        self.inflight.append(flight)
        if self.placements is not None:
            notice = None
            if emergency:  # the engine asks again with the notice (Tiers.secure)
                notice = self.notice or Notice(t, math.inf, "emergency save")
            self.placements.place(
                version,
                self.step,
                start,
                durable,
                now=t,
                notice=notice,
                policy_state=state,
                cost=measured(flight),
                life=self.life,
            )
        self.stall += end - t
        self.ledger.saved((self.step,))
        self.seg_t0, self.seg_step0, self.t = end, self.step, end
        self.feed.saved(self.step, end)
        return end - t

    def _commit_durable(self, now: float, report: bool) -> None:
        """Commit (and report to the policy) every save durable by ``now``, oldest first."""
        if not self.inflight or min(f.durable_at for f in self.inflight) > now:
            return
        done = sorted((f for f in self.inflight if f.durable_at <= now), key=by_durable)
        self.inflight = [f for f in self.inflight if f.durable_at > now]
        for f in done:
            cost = measured(f)
            if f.step > self.commit.step:
                self._set_commit(f.step, f.version, f.durable_at, f.policy_state, cost)
            if report:
                stall, duration = cost
                self.feed.committed(stall, duration)
                self.policy.observe(
                    SaveCompleted(
                        f.version, f.step, now, stall, duration, self.job.checkpoint_bytes
                    )
                )

    def _set_commit(
        self, step: int, version: int, at: float, state: dict | None, cost: SaveCost | None
    ) -> None:
        c = self.commit
        c.step, c.version, c.time, c.policy_state, c.cost = step, version, at, state, cost
        c.life = self.life

    def _advance_commit(self, at: float) -> None:
        """The steps done up to here count as kept, in the newest version's place (the job
        ended without saving them: no version holds them)."""
        c = self.commit
        self._set_commit(self.step, c.version, at, c.policy_state, c.cost)

    # --- endings ------------------------------------------------------------------------------
    def _finish(self) -> None:
        """The last step is done: make it durable (blocking) and end the process."""
        end = self._save_and_drain(self.t, save=self.job.final_save)
        if not self.job.final_save:
            self._advance_commit(end)
        self.finished = True
        self._close(end, kept=self.step)

    def stop(self, at: float) -> float:
        """Planned stop (a resource change) at ``at``: blocking save; returns when it ended."""
        if self.ended:
            return at
        if at < self.ready:  # still starting: nothing to save
            self._lose_vms(at)
            self._close(at, kept=self.step)
            return at
        self.run_until(at)
        if self.finished:
            return max(at, self.t)
        end = self._save_and_drain(max(at, self.t), save=True, secure=True)
        # The VMs are given back: what only they held is gone (with placements).
        kept = self.commit.step if self._lose_vms(end) else self.step
        self._close(end, kept=kept)
        return end

    def _save_and_drain(self, t: float, save: bool, secure: bool = False) -> float:
        """A blocking save of the current step at ``t`` (if ``save`` and no version holds
        it yet), then every version in flight made durable; returns when that ended.

        ``secure`` (a planned stop, with placements): the version of the current step is
        placed as on a notice, so that it reaches a tier that outlives the VMs."""
        end = t
        saved = any(f.step == self.step for f in self.inflight)
        if save and not saved and self.commit.step < self.step:
            end = t + self.job.save_duration
            state = saved_state(self.policy)
            version = self.versions.take()
            flight = Flight(version, self.step, t, end, end - t, state)
            self.inflight.append(flight)
            self.ledger.saved((self.step,))
            if self.placements is not None:
                self.placements.place(
                    version,
                    self.step,
                    t,
                    end,
                    now=t,
                    notice=None,
                    policy_state=state,
                    cost=measured(flight),
                    life=self.life,
                )
        if secure and self.placements is not None:
            newest = max(self.inflight, key=lambda f: f.step, default=None)
            if newest is not None and newest.step == self.step:
                self.placements.secure(
                    newest.version,
                    newest.step,
                    newest.durable_at,
                    at=t,
                    policy_state=newest.policy_state,
                    cost=measured(newest),
                    life=self.life,
                )
        end = max([end] + [f.durable_at for f in self.inflight])
        self.stall += end - t
        self.t = end
        self._commit_durable(end, report=False)
        return end

    def kill(self, at: float) -> int:
        """SIGKILL at ``at``: keep what was durable by then; returns the steps lost."""
        if self.ended:
            return 0
        if at >= self.ready:
            self.run_until(at)
            self._replay(at)
        self._commit_durable(at, report=False)
        self.ledger.saves_lost += len(self.inflight)
        self.inflight = []
        self._lose_vms(at)
        lost = max(self.step - self.commit.step, 0)
        if self.t > at:  # killed inside a stall: only the part before the kill happened
            self.stall -= self.t - at
            self.t = at
        self._close(at, kept=self.commit.step)
        return lost

    def end_of_trace(self, at: float) -> None:
        """The simulated window ends: the steps done count (the job is not preempted)."""
        if self.ended:
            return
        if at >= self.ready:
            self.run_until(at)
        if self.t > at:
            self.stall -= self.t - at
            self.t = at
        self._commit_durable(at, report=False)
        self._close(at, kept=self.step)
        if self.step > self.commit.step:
            self._advance_commit(at)

    def _lose_vms(self, at: float) -> bool:
        """With placements: the job's VMs are gone at ``at``, with every version only they
        held; the restore point becomes the newest version in a tier that survives (none:
        the job starts over). The engine then numbers versions above the newest it finds.
        Returns whether placements are modelled."""
        if self.placements is None:
            return False
        found = self.placements.lose(at)
        c = self.commit
        if found is None:
            c.step, c.version, c.time, c.policy_state, c.life = 0, 0, -math.inf, None, -1
            c.cost = None
        else:
            c.step, c.version, c.time = found.step, found.version, found.durable_at
            c.policy_state, c.life, c.cost = found.policy_state, found.life, found.cost
        self.versions.next = c.version + 1
        return True

    def _close(self, end: float, kept: int) -> None:
        self.ended = True
        led = self.ledger
        led.restart += min(self.restart_cost, end - self.start)
        if end <= self.ready:
            return
        training = end - self.ready
        stall = min(self.stall, training)
        compute = training - stall
        kept_steps = max(kept - self.step0, 0)
        useful = min(kept_steps * self.it, compute)
        led.stall += stall
        led.useful += useful
        led.lost += compute - useful
        led.kept_steps += kept_steps
        led.lost_steps += max(self.step - kept, 0)
