"""Emergency checkpoint on a preemption notice, wrapped around any periodic policy.

On a notice with deadline D at time t: if the time to durable fits into D − t − ``margin``,
save now and let the engine wait for it; otherwise don't start a save that would die
half-written and rely on the last periodic one. The time to durable is that of the fastest
tier that survives the VM when the engine estimates one (``ctx.tier_write_times`` for the
tiers named in ``tiers``: an emergency save goes there, not to the periodic saves' tier),
else the learned time of the periodic saves (pessimistic: mean + ``z`` deviations).
"""

from __future__ import annotations

import math
from typing import Any

from pcframe.policies.base import (
    Decision,
    Event,
    IntervalPolicy,
    Notice,
    PolicyContext,
    Restarted,
    SaveCompleted,
    SaveHint,
    same_deadline,
)
from pcframe.policies.estimates import RunningEstimate
from pcframe.policies.notices.base import NoticeSource, polled
from pcframe.policies.registry import register
from pcframe.runtime.checks import require_object
from pcframe.text import seconds_text, value_text


@register()
class NoticeDriven(IntervalPolicy):
    """Adds notice handling to ``inner`` (any interval policy, or none at all).

    Args:
        inner: the periodic policy consulted when no notice is pending (``None``: never
            save except on a notice).
        source: where notices come from besides ``ctx.notice`` (started lazily on the first
            ``decide``, which must then run in the main thread for a signal source).
        margin: seconds kept free before the deadline (process exit, flush, clock skew).
        save_time_prior: seconds to durable assumed until a save has been measured.
        z: how many mean deviations of the save time to add for safety.
        alpha: smoothing of the learned save time.
        tiers: the tiers that survive the loss of the VM, where the placement sends an
            emergency save (for :class:`~pcframe.policies.placement.TieredPlacement`, the
            rules with ``survives_preemption``; name yours, the engine's names depend on the
            storage config). ``"survivor"`` is the simulator's (``JobSpec.survivor_...``).
    """

    name = "notice"

    def __init__(
        self,
        inner: IntervalPolicy | None = None,
        source: NoticeSource | None = None,
        *,
        margin: float = 5.0,
        save_time_prior: float = 30.0,
        z: float = 2.0,
        alpha: float = 0.3,
        tiers: tuple[str, ...] | list[str] = ("survivor",),
    ) -> None:
        if not (margin >= 0 and z >= 0):  # NaN too
            raise ValueError(f"margin={margin} and z={z} must be >= 0")
        # Checked here, not at the first decide deep inside: a class or a name given where
        # an object goes, and a tiers string read as its letters ('s', 'u', ...) silently.
        require_object("inner", inner, IntervalPolicy, "an interval policy", "Daly(mtbf=3600.0)")
        require_object(
            "source", source, NoticeSource, "a notice source", "SignalNoticeSource(['SIGTERM'])"
        )
        if isinstance(tiers, str | bytes) or not all(isinstance(t, str) for t in tiers):
            raise TypeError(
                f"tiers={value_text(tiers)} must be a list of tier names, e.g. ['survivor']"
            )
        self.inner = inner
        self.source = source
        self.margin = float(margin)
        self.z = float(z)
        self.tiers = tuple(tiers)
        self.save_time = RunningEstimate(save_time_prior, alpha)
        self._started = False
        self._handled: float | None = None  # deadline of the notice already acted upon
        # Step of the emergency save in flight for the current notice; at the next restart
        # it says whether the notice secured the newest state (restored from that step).
        self._emergency_step: int | None = None
        # Beta(secured, missed) over preemptions: how often a notice saved the work. The
        # inner policy plans its periodic interval only for the missed ones.
        self.secured, self.missed = 1.0, 1.0
        self.last_notice_decision: Decision | None = None

    def estimated_save_time(self, ctx: PolicyContext) -> float:
        """Seconds from an emergency ``save()`` to durable: the fastest surviving tier's
        estimate if the engine gives one, else pessimistic, learned from completed saves."""
        known = [ctx.tier_write_times[t] for t in self.tiers if t in ctx.tier_write_times]
        if known:
            return min(known)
        return self.save_time.upper(self.z, ctx.save_duration)

    def _notice(self, ctx: PolicyContext) -> Notice | None:
        if self.source is not None and not self._started:
            self.source.start()
            self._started = True
        notice = ctx.notice
        if self.source is not None:
            own = polled(self.source, ctx.now)
            if notice is None or (own is not None and own.deadline < notice.deadline):
                notice = own  # the earlier deadline is the one that matters
        return notice

    def decide(self, ctx: PolicyContext) -> Decision:
        notice = self._notice(ctx)
        if notice is not None and ctx.now > notice.deadline:
            # Still alive after the deadline: a false alarm (or a late kill). Resume normally.
            if self.source is not None:
                self.source.reset()
            self._handled = None
            notice = None
        if notice is None:
            return self.inner.decide(ctx) if self.inner is not None else Decision(False)
        if self._handled is not None and same_deadline(self._handled, notice.deadline):
            return Decision(False, "preemption notice already handled; waiting for the end")
        self._handled = notice.deadline
        left = notice.deadline - ctx.now
        need = self.estimated_save_time(ctx)
        # Nothing measured yet (no save finished, no tier estimate): the prior is a guess, and
        # a save that does not finish in time loses nothing the last commit holds, while not
        # trying loses every step since it (all of them, before a first commit).
        unmeasured = (
            self.save_time.count == 0
            and ctx.save_duration is None
            and not any(t in ctx.tier_write_times for t in self.tiers)
        )
        if ctx.last_save_step is not None and ctx.last_save_step >= ctx.step:
            d = Decision(False, f"notice: step {ctx.step} is already saved")
        elif unmeasured and self.margin < left:
            self._emergency_step = ctx.step
            d = Decision(
                True,
                f"notice ({notice.source}): no save measured yet, {seconds_text(left)} s left: "
                "trying",
                emergency=True,
            )
        elif need + self.margin <= left:
            self._emergency_step = ctx.step
            d = Decision(
                True,
                f"notice ({notice.source}): save takes ~{seconds_text(need)} s, "
                f"{seconds_text(left)} s left",
                emergency=True,
            )
        else:
            d = Decision(
                False,
                f"notice ({notice.source}): save needs ~{seconds_text(need)} s + "
                f"{seconds_text(self.margin)} s margin > {seconds_text(left)} s left; relying "
                "on the last periodic checkpoint",
            )
        # The inner policy is not asked while a notice is pending: it would record a periodic
        # save that never happens.
        self.last_notice_decision = d
        return d

    @property
    def changes_with_clock(self) -> bool:  # type: ignore[override]
        """Between notices this policy is its inner policy (see IntervalPolicy)."""
        return bool(getattr(self.inner, "changes_with_clock", False))

    def save_hint(self, ctx: PolicyContext) -> SaveHint | None:
        # Notices are delivered by the caller (it decides again when one arrives); between
        # notices this policy is its inner policy, or never saves.
        if self.inner is None:
            return SaveHint(time=math.inf)
        hint = self.inner.save_hint(ctx)
        if hint is None:
            return None
        time = hint.time
        if self._handled is not None and ctx.now <= self._handled:
            # A notice is being handled: nothing more is saved before its deadline.
            time = self._handled if time is None else max(time, self._handled)
        # Never periodic: this policy's own state learns from every completed save.
        return SaveHint(step=hint.step, time=time)

    def observe(self, event: Event) -> None:
        if isinstance(event, SaveCompleted):
            self.save_time.update(event.duration)
        elif isinstance(event, Restarted):
            if not event.clean:
                hit = self._emergency_step is not None and event.step == self._emergency_step
                self.secured += 1.0 if hit else 0.0
                self.missed += (0.0 if hit else 1.0) + event.unseen_starts
            self._handled = None
            self._emergency_step = None
            self._scale_inner()
        if self.inner is not None:
            self.inner.observe(event)

    def miss_fraction(self) -> float:
        """Posterior mean share of preemptions a notice did not secure."""
        return self.missed / (self.secured + self.missed)

    def _scale_inner(self) -> None:
        # Only the preemptions no notice secures cost work: a rate-driven inner policy
        # (``rate_scale``, e.g. PreemptionAware) plans its periodic saves for those.
        if self.inner is not None and hasattr(self.inner, "rate_scale"):
            self.inner.rate_scale = self.miss_fraction()

    def close(self) -> None:
        """Release the notice source (signal handlers, poller thread)."""
        if self.source is not None:
            self.source.close()
        self._started = False

    def state_dict(self) -> dict[str, Any]:
        return {
            "save_time": self.save_time.state_dict(),
            "handled": self._handled,
            "emergency_step": self._emergency_step,
            "notices": [self.secured, self.missed],
            "inner": self.inner.state_dict() if self.inner is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.save_time.load_state_dict(state.get("save_time", {}))
        self._handled = state.get("handled")
        self._emergency_step = state.get("emergency_step")
        self.secured, self.missed = (float(x) for x in state.get("notices", [1.0, 1.0]))
        if self.inner is not None and state.get("inner") is not None:
            self.inner.load_state_dict(state["inner"])
        self._scale_inner()
