"""Preemption-aware interval (after EuroMLSys '26): Daly's optimum at the *predicted* rate.

A :class:`~pcframe.policies.predictors.Predictor` (seeded from historical traces, updated with
the job's own preemptions) gives the rate λ; the interval is Daly's τ*(C, 1/λ) with C learned
from the engine. The prediction moves all the time, so the adopted interval only changes when
the new value differs by more than ``hysteresis`` (relative): otherwise a noisy estimate
would jitter the checkpoint schedule without any gain.

Refinements make it learn like the traces behave (docs/policies.md, "How PA learns"):
when the predictor knows how over-dispersed lives are, the interval follows the VM's age
(``age_hazard``, ``schedule``: short intervals right after a restart, long ones once the
VM has proved stable), and restarts
whose state died with them (``Restarted.unseen_starts``) are counted, so harsh zones are
not mistaken for calm ones.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import numpy as np

from pcframe.policies.base import Event, PolicyContext, Preempted, Restarted, SaveHint
from pcframe.policies.daly import Form, daly_interval
from pcframe.policies.periodic import SecondsIntervalPolicy
from pcframe.policies.predictors.base import Predictor, checked_prediction
from pcframe.policies.predictors.gamma_poisson import GammaPoissonRate
from pcframe.policies.predictors.lifetime import LifeShapePosterior, cycle_interval
from pcframe.policies.predictors.lives_plan import (
    EmpiricalLives,
    LifeBlend,
    lives_interval,
    prior_survival,
)
from pcframe.policies.predictors.schedule import kept_work_schedule
from pcframe.policies.registry import register
from pcframe.policies.young import CostKind, checkpoint_cost
from pcframe.runtime.checks import require_object

Bound = Literal["mean", "upper"]
Schedule = Literal["kept_work", "cycle", "lives"]


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
        age_hazard: plan with the hazard at the VM's age (time since training resumed)
            when the predictor has a life shape (``GammaPoissonRate.from_traces`` fits one):
            ``MTBF_eff = ((k - 1)·MTBF + age) / k``. ``False``: the mean rate at every age.
        schedule: with ``age_hazard``, how the interval at an age is chosen: ``cycle``
            (the best ratio of one cycle at that age,
            :func:`~.predictors.lifetime.cycle_interval`; the default, ahead on the mean of
            both regimes of experiment 5), ``kept_work`` (the schedule that maximises the
            work a whole life keeps, Bellman's equation of :mod:`~.predictors.schedule`;
            ahead on the harshest traces) or ``lives`` (the ``cycle`` ratio under the
            job's own lives blended with the prediction, :mod:`~.predictors.lives_plan`;
            opt-in: behind ``cycle`` in experiment 5).
        **kw: clamps and priors of :class:`~pcframe.policies.periodic.SecondsIntervalPolicy`;
            ``min_interval`` and ``max_interval`` bound τ whatever the prediction says.
    """

    name = "preemption_aware"
    changes_with_clock = True  # re-predicts every reevaluate_every s and follows the age

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
        age_hazard: bool = True,
        schedule: Schedule = "cycle",
        **kw: Any,
    ) -> None:
        if bound not in ("mean", "upper"):
            raise ValueError(f"bound={bound!r} must be 'mean' or 'upper'")
        if not 0.0 <= hysteresis < 1.0:
            raise ValueError(f"hysteresis={hysteresis} must be in [0, 1)")
        if form not in ("exact", "series"):
            raise ValueError(f"form={form!r} must be 'exact' or 'series'")
        if schedule not in ("kept_work", "cycle", "lives"):
            raise ValueError(f"schedule={schedule!r} must be 'lives', 'cycle' or 'kept_work'")
        if not reevaluate_every >= 0:  # NaN too
            raise ValueError(f"reevaluate_every={reevaluate_every} must be >= 0 seconds")
        if predictor is None and not (math.isfinite(mtbf_prior) and mtbf_prior > 0):
            raise ValueError(f"mtbf_prior={mtbf_prior} must be a finite number of seconds > 0")
        super().__init__(max_interval=max_interval, **kw)
        # A class or a name failed at the first decide, deep inside.
        require_object("predictor", predictor, "predict", "a predictor", "GammaPoissonRate(3600.0)")
        self.predictor = predictor if predictor is not None else GammaPoissonRate(mtbf_prior)
        self.form: Form = form
        self.bound: Bound = bound
        self.hysteresis = hysteresis
        self.cost: CostKind = cost
        self.count_restarts = count_restarts
        self.reevaluate_every = float(reevaluate_every)
        self.age_hazard = age_hazard
        self.schedule: Schedule = schedule
        # Share of preemptions that cost work: set by a NoticeDriven wrapper that learns how
        # often notices secure the newest state (1.0: every preemption loses work).
        self.rate_scale = 1.0
        # Predictor-clock time this process started training (None: at the next decide).
        self._life_start: float | None = None
        self._age = 0.0
        self._cycle_memo: dict[tuple, float] = {}  # not state: a cache of a pure function
        self._empirical: tuple[tuple, EmpiricalLives] | None = None  # (what it was built on, it)
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
        if self._life_start is None or now < self._life_start:
            self._life_start = now  # the first call of this process (or a clock jump)
        self._age = now - self._life_start
        due = self._evaluated is None or not 0 <= now - self._evaluated < self.reevaluate_every
        if self._rate is None or due:
            # Exposure is credited here (and by every event), not at every call: the
            # predictor then does the same arithmetic however often decide is asked between
            # two predictions, so a caller following save_hint gets the same rates to the
            # last bit as the engine asking at every step.
            self.predictor.advance(now)
            mean = getattr(self.predictor, "mean_rate", None)
            if self.bound == "mean" and callable(mean):
                self._rate = mean()  # the same value, without the interval's quantiles
            else:
                est = checked_prediction(self.predictor, self.predictor.predict(now)).rate
                self._rate = est.upper if self.bound == "upper" else est.value
            self._evaluated = now
        return self._rate * self.rate_scale

    def age(self, ctx: PolicyContext) -> float:
        """Seconds since training (re)started in this process: the VM's age that matters."""
        self.rate(ctx)  # moves the predictor clock and starts a new life if one is due
        return self._age

    def planning_mtbf(self, ctx: PolicyContext) -> float:
        """1 / the hazard to plan with: the rate's, at the VM's age (for inspection)."""
        rate = self.rate(ctx)
        mtbf = math.inf if not rate > 0 else 1.0 / rate
        at_age = getattr(self.predictor, "mtbf_at_age", None)
        if self.age_hazard and callable(at_age):
            mtbf = at_age(self._age, mtbf)
        return mtbf

    def target_interval(self, ctx: PolicyContext) -> float:
        rate = self.rate(ctx)
        cost = checkpoint_cost(self, ctx, self.cost)
        lives = getattr(self.predictor, "lives", None)
        if math.isinf(rate):  # e.g. the upper bound before any exposure: save when allowed
            tau = 0.0
        elif self.age_hazard and isinstance(lives, LifeShapePosterior):
            tau = self._cycle(rate, cost, self.costs.save_duration(ctx), lives)
        else:
            mtbf = math.inf if not rate > 0 else 1.0 / rate
            tau = daly_interval(cost, mtbf, self.form)
        if self._should_adopt(tau):
            self.adopted = tau
        return self.adopted

    def save_hint(self, ctx: PolicyContext) -> SaveHint | None:
        """The base class's hint, brought forward to the next time a call of ``decide`` may
        change the interval with no event: the next prediction (``reevaluate_every`` after
        the last) and, when the interval follows the VM's age, the next age bucket.

        Asked at every step (the engine), the hysteresis sees every interval on the way and
        the predictor is asked every ``reevaluate_every`` s; a caller that skipped those
        calls would adopt other intervals (issue 43: -3.8 to +1.1 % of goodput per trace on
        the simulator's hinted path). Calls in between change nothing later answers depend
        on, so they may be skipped. ``None`` (ask at every step) where every call may
        change the interval: ``reevaluate_every=0`` and the ``kept_work`` schedule, which
        interpolates the interval at the exact age."""
        hint = super().save_hint(ctx)
        if hint is None or self._life_start is None or self._evaluated is None:
            return None
        if self.reevaluate_every <= 0:
            return None
        recheck = self._evaluated + self.reevaluate_every  # the predictor's clock
        if self._follows_age():
            if self.schedule == "kept_work":
                return None
            bucket = _age_bucket(self._age)
            recheck = min(recheck, self._life_start + 60.0 * math.expm1((bucket + 0.5) / 20.0))
        if not math.isfinite(recheck):  # never re-predicts between events
            return hint
        at = recheck - self._offset  # ctx.now's clock
        # A few ulps early: the clock shift and the bucket's inverse round, and a call just
        # before the point changes nothing (it is asked again at the next step).
        at -= 64.0 * math.ulp(max(abs(recheck), abs(at), 1.0))
        if hint.time is not None and hint.time <= at:
            return hint
        return SaveHint(step=hint.step, time=at)

    def _follows_age(self) -> bool:
        """Whether the interval depends on the VM's age (the life-shape schedules)."""
        lives = getattr(self.predictor, "lives", None)
        return self.age_hazard and isinstance(lives, LifeShapePosterior)

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
            died = event.time + self._offset
            if self._life_start is not None:
                age = died - self._life_start
                self._observe_life(age, age + max(1.0, 0.01 * age))
            self.predictor.observe(dataclasses.replace(event, time=died))
        elif isinstance(event, Restarted):
            if self._last_now is not None:
                # The predictor's clock runs from prediction to prediction (rate()); a
                # restart stops it uncredited, so credit the exposure up to the last call.
                self.predictor.advance(self._last_now)
            if self.count_restarts and not self._preempted_since_restart and not event.clean:
                # When the old process died is unknown; the last time it was seen (restored
                # from the checkpoint) is a safe guess. The restart time itself is on a new
                # process's clock, so it is not used: exposure resumes at the next decide.
                seen_at = self._last_now if self._last_now is not None else 0.0
                if self._life_start is not None:
                    # Alive at its last checkpoint, dead before the next could be durable.
                    seen = seen_at - self._life_start
                    self._observe_life(seen, seen + self._window())
                # It ran on after that checkpoint: credit half of that window as exposure
                # (counting none would overstate the rate by a fraction of every interval).
                died = seen_at + self._window() / 2.0
                self.predictor.advance(died)
                self.predictor.observe(Preempted(time=died))
                self._count_unseen(died, event.unseen_starts)
            self._preempted_since_restart = False
            self._life_start = None  # the new life starts at the next decide
            self.predictor.observe(event)
        else:
            self.predictor.observe(event)

    def _cycle(self, rate: float, stall: float, durable: float, lives: LifeShapePosterior) -> float:
        """Seconds from this save's start to the next at this age, memoised on bucketed
        inputs (MTBF and age to 5 %, costs to 0.1 s, shape weights to 0.05: finer than the
        20 % hysteresis). ``cycle``: :func:`~.lifetime.cycle_interval` per age bucket (a
        45-day trace needs a few hundred). ``lives``: the same under the blend of the job's
        lives and the prediction (:func:`~.lives_plan.lives_interval`), per age bucket and
        set of lives. ``kept_work``: the schedule of
        :func:`~.schedule.kept_work_schedule` plus the stall; it covers every age, so it is
        memoised without the age (a few dozen) and the age is read off by interpolation."""
        mtbf = math.inf if not rate > 0 else 1.0 / rate
        if math.isinf(mtbf):
            return math.inf
        raw = lives.weights(0.0, mtbf)
        weights = tuple(round(20.0 * w) / 20.0 for w in raw)
        if not any(weights):  # every weight rounded away: keep the heaviest
            weights = tuple(float(w == max(raw)) for w in raw)
        mtbf_b = round(20.0 * math.log(mtbf))
        if self.schedule == "lives":  # one evaluation per age bucket and set of lives
            age_b = _age_bucket(self._age)
            stall_b, durable_b = round(stall, 1), round(max(durable, stall), 1)
            key = ("lives", mtbf_b, age_b, stall_b, durable_b, weights, lives.version)
            tau = self._cycle_memo.get(key)
            if tau is None:
                if len(self._cycle_memo) > 4096:
                    self._cycle_memo.clear()
                # The lives are spread within their windows as the prediction says, so
                # they are rebuilt when it moves (a new life, a new MTBF or shape bucket).
                built = (lives.version, mtbf_b, weights)
                if self._empirical is None or self._empirical[0] != built:
                    shape = prior_survival(math.exp(mtbf_b / 20.0), weights)
                    self._empirical = (built, EmpiricalLives(lives.lives, shape))
                blend = LifeBlend(
                    self._empirical[1],
                    self._prior_lives(),
                    math.exp(mtbf_b / 20.0),
                    weights,
                    60.0 * math.expm1(age_b / 20.0),
                )
                tau = lives_interval(blend, stall_b, durable_b)
                self._cycle_memo[key] = tau
            return tau
        if self.schedule == "cycle":  # one evaluation per age bucket (5 %)
            age_b = _age_bucket(self._age)
            key = ("cycle", mtbf_b, age_b, round(stall, 1), round(durable, 1), weights)
            tau = self._cycle_memo.get(key)
            if tau is None:
                if len(self._cycle_memo) > 4096:
                    self._cycle_memo.clear()
                age = 60.0 * math.expm1(age_b / 20.0)
                tau = cycle_interval(
                    age, math.exp(mtbf_b / 20.0), key[3], max(key[4], key[3]), list(weights)
                )
                self._cycle_memo[key] = tau
            return tau
        key = (mtbf_b, round(stall, 1), round(durable, 1), weights)
        table = self._cycle_memo.get(key)
        if table is None:
            if len(self._cycle_memo) > 512:
                self._cycle_memo.clear()
            table = kept_work_schedule(
                math.exp(mtbf_b / 20.0), key[1], max(key[2], key[1]), list(weights)
            )
            self._cycle_memo[key] = table
        ages, taus = table
        return float(np.interp(self._age, ages, taus)) + stall

    def _prior_lives(self) -> float:
        """How many lives the predictor's prior is worth against the job's own (the
        pseudo-preemptions of its rate prior; 1 where it does not say)."""
        worth = getattr(self.predictor, "prior_lives", None)
        return float(worth) if isinstance(worth, (int, float)) and worth > 0 else 1.0

    def _count_unseen(self, died: float, lives: int) -> None:
        """Preemptions of processes that never committed: each died before its first save
        was durable, so it trained for less than one interval plus the time to durable;
        half of that is credited as its exposure (the predictor's clock is shifted, never
        moved back past ``died``)."""
        if lives <= 0:
            return
        window = self._window()
        t = died
        for _ in range(lives):
            self._observe_life(0.0, window)
            self.predictor.advance(t)
            t += window / 2.0
            self.predictor.observe(Preempted(time=t))

    def _window(self) -> float:
        """How long after a save its successor is durable: the span a death falls into."""
        tau = self.adopted if self.adopted is not None and math.isfinite(self.adopted) else 0.0
        return tau + self.costs.duration.value()

    def _observe_life(self, lo: float, hi: float) -> None:
        observe = getattr(self.predictor, "observe_life", None)
        if callable(observe):
            observe(lo, hi)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "life_start": self._life_start,
            "age": self._age,
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
        self._life_start = state.get("life_start")
        self._age = float(state.get("age", 0.0))


def _age_bucket(age: float) -> int:
    """The ``cycle`` schedule's age bucket (5 % of ``1 + age / 60 s``): the interval at an
    age is the one at the bucket's centre, so it changes only where the bucket does."""
    return round(20.0 * math.log1p(age / 60.0))


def _json_float(x: float | None) -> float | str | None:
    """JSON has no infinity: store it as the string "inf" (``float("inf")`` reads it back)."""
    return "inf" if x is not None and math.isinf(x) else x
