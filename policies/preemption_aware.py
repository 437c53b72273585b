"""Preemption-aware interval (after EuroMLSys '26): Daly's optimum at the *predicted* rate.

A :class:`~pcframe.policies.predictors.Predictor` (seeded from historical traces, updated with
the job's own preemptions) gives the rate λ; the interval is Daly's τ*(C, 1/λ) with C learned
from the engine. The prediction moves all the time, so the adopted interval only changes when
the new value differs by more than ``hysteresis`` (relative): otherwise a noisy estimate
would jitter the checkpoint schedule without any gain.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from pcframe.policies.base import Event, PolicyContext, Preempted, Restarted
from pcframe.policies.daly import Form, daly_interval
from pcframe.policies.periodic import SecondsIntervalPolicy
from pcframe.policies.predictors.base import Predictor
from pcframe.policies.predictors.gamma_poisson import GammaPoissonRate
from pcframe.policies.registry import register
from pcframe.policies.young import CostKind, checkpoint_cost

Bound = Literal["mean", "upper"]


@register()
class PreemptionAware(SecondsIntervalPolicy):
    """Daly interval driven by a preemption-rate predictor, with hysteresis and clamps.

    Args:
        predictor: where λ comes from. Default: :class:`GammaPoissonRate` with ``mtbf_prior``,
            which the job's own preemptions then correct.
        mtbf_prior: MTBF in seconds assumed by the default predictor.
        form: Daly optimum, ``exact`` or ``series``.
        bound: plan with the ``mean`` rate or the ``upper`` end of its interval (risk-averse:
            shorter intervals while the estimate is uncertain).
        hysteresis: relative change of τ needed before the schedule is changed.
        cost: ``stall`` or ``duration`` (see :class:`~pcframe.policies.young.Young`).
        count_restarts: treat a ``Restarted`` event not preceded by ``Preempted`` as a
            preemption (on spot VMs, restarts are nearly always preemptions), unless it
            says the previous process closed cleanly (``Restarted.clean``).
        reevaluate_every: seconds between two predictions (a prediction costs ~100 µs, a
            step may be shorter); any observed event forces one at the next step.
        **kw: clamps and priors of :class:`~pcframe.policies.periodic.SecondsIntervalPolicy`;
            ``min_interval`` and ``max_interval`` bound τ whatever the prediction says.
    """

    name = "preemption_aware"

    def __init__(
        self,
        predictor: Predictor | None = None,
        *,
        mtbf_prior: float = 3600.0,
        form: Form = "exact",
        bound: Bound = "mean",
        hysteresis: float = 0.2,
        cost: CostKind = "stall",
        count_restarts: bool = True,
        reevaluate_every: float = 30.0,
        max_interval: float | None = 6 * 3600.0,
        **kw: Any,
    ) -> None:
        if bound not in ("mean", "upper"):
            raise ValueError(f"bound={bound!r} must be 'mean' or 'upper'")
        if not 0.0 <= hysteresis < 1.0:
            raise ValueError(f"hysteresis={hysteresis} must be in [0, 1)")
        if form not in ("exact", "series"):
            raise ValueError(f"form={form!r} must be 'exact' or 'series'")
        if reevaluate_every < 0:
            raise ValueError(f"reevaluate_every={reevaluate_every} must be >= 0 seconds")
        super().__init__(max_interval=max_interval, **kw)
        self.predictor = predictor if predictor is not None else GammaPoissonRate(mtbf_prior)
        self.form: Form = form
        self.bound: Bound = bound
        self.hysteresis = hysteresis
        self.cost: CostKind = cost
        self.count_restarts = count_restarts
        self.reevaluate_every = float(reevaluate_every)
        self._rate: float | None = None  # the rate of the last prediction...
        self._evaluated: float | None = None  # ...made at this predictor-clock time
        self.adopted: float | None = None  # the τ in force (before clamps)
        self._preempted_since_restart = False
        # The predictor runs on the wall clock when the engine gives one (time-of-day
        # hazards need it), else on ctx.now; events arrive on ctx.now's clock and are shifted.
        self._offset = 0.0
        self._last_now: float | None = None  # last predictor-clock time: best guess of a death

    def rate(self, ctx: PolicyContext) -> float:
        """The preemption rate (per second) planned with at ``ctx.now``."""
        now = ctx.now if ctx.wall_time is None else ctx.wall_time
        self._offset = now - ctx.now
        self._last_now = now
        self.predictor.advance(now)
        due = self._evaluated is None or not 0 <= now - self._evaluated < self.reevaluate_every
        if self._rate is None or due:
            est = self.predictor.predict(now).rate
            self._rate = est.upper if self.bound == "upper" else est.value
            self._evaluated = now
        return self._rate

    def target_interval(self, ctx: PolicyContext) -> float:
        rate = self.rate(ctx)
        if math.isinf(rate):  # e.g. the upper bound before any exposure: save when allowed
            tau = 0.0
        else:
            mtbf = math.inf if not rate > 0 else 1.0 / rate
            tau = daly_interval(checkpoint_cost(self, ctx, self.cost), mtbf, self.form)
        if self._should_adopt(tau):
            self.adopted = tau
        return self.adopted

    def _should_adopt(self, tau: float) -> bool:
        old = self.adopted
        if old is None or math.isinf(old) or math.isinf(tau):
            return old != tau  # inf vs finite is always a real change; inf - inf is not
        return abs(tau - old) > self.hysteresis * old

    def observe(self, event: Event) -> None:
        super().observe(event)
        self._evaluated = None  # new evidence (or a new cost): predict again at the next step
        if isinstance(event, Preempted):
            self._preempted_since_restart = True
            self.predictor.observe(dataclasses.replace(event, time=event.time + self._offset))
        elif isinstance(event, Restarted):
            if self.count_restarts and not self._preempted_since_restart and not event.clean:
                # When the old process died is unknown; the last time it was seen (restored
                # from the checkpoint) is a safe guess. The restart time itself is on a new
                # process's clock, so it is not used: exposure resumes at the next decide.
                died = self._last_now if self._last_now is not None else 0.0
                self.predictor.observe(Preempted(time=died))
            self._preempted_since_restart = False
            self.predictor.observe(event)
        else:
            self.predictor.observe(event)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "predictor": self.predictor.state_dict(),
            "adopted": _json_float(self.adopted),
            "preempted": self._preempted_since_restart,
            "last_now": self._last_now,
            "offset": self._offset,
            "rate": _json_float(self._rate),
            "evaluated": self._evaluated,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.predictor.load_state_dict(state.get("predictor", {}))
        adopted = state.get("adopted")
        self.adopted = None if adopted is None else float(adopted)
        self._preempted_since_restart = bool(state.get("preempted", False))
        self._last_now = state.get("last_now")
        self._offset = float(state.get("offset", 0.0))
        rate = state.get("rate")
        self._rate = None if rate is None else float(rate)
        self._evaluated = state.get("evaluated")


def _json_float(x: float | None) -> float | str | None:
    """JSON has no infinity: store it as the string "inf" (``float("inf")`` reads it back)."""
    return "inf" if x is not None and math.isinf(x) else x
