"""Generic tests every pcframe policy must pass; plugin authors subclass them in pytest.

    from pcframe.testing import IntervalPolicyConformance

    class TestMyPolicy(IntervalPolicyConformance):
        factory = staticmethod(lambda: MyPolicy(every=5))

Each kit drives the policy through a deterministic scenario (measurements missing at first,
costs changing midway, a preemption and restart, events of every type) and checks the
contract: types returned, determinism, JSON state that restores behaviour exactly, no
exception on missing measurements. Set ``expects_periodic_saves = False`` (interval policies
that only react to notices) or ``learns_online = False`` (predictors that ignore the job's
own events) where a property does not apply.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from pcframe.policies.base import (
    Decision,
    IntervalPolicy,
    Notice,
    PolicyContext,
    Preempted,
    Restarted,
    SaveCompleted,
)
from pcframe.policies.placement.base import PlacementContext, PlacementDecision, PlacementPolicy
from pcframe.policies.predictors.base import Estimate, Prediction, Predictor
from pcframe.policies.resource.base import ResourceContext, ResourceDecision, ResourcePolicy


def json_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """What the engine does with a state dict: strict JSON (no NaN/inf) out and back in."""
    assert isinstance(state, dict), f"state_dict() must return a dict, got {type(state)}"
    text = json.dumps(state, allow_nan=False)
    back = json.loads(text)
    assert back == state, "state_dict() must hold JSON types only (no tuples, numpy, objects)"
    return back


class _Kit:
    """Factory plumbing shared by the kits."""

    factory: ClassVar[Callable[[], Any] | None] = None

    def make(self) -> Any:
        """A fresh policy; override this or set ``factory`` on the subclass."""
        factory = type(self).factory
        if factory is None:
            raise NotImplementedError(
                f"{type(self).__name__}: set `factory = staticmethod(lambda: MyPolicy(...))` "
                "or override make()"
            )
        return factory()


# --- interval policies ----------------------------------------------------------------------


@dataclass
class IntervalDriver:
    """A tiny deterministic stand-in for the engine: time, steps, saves, a preemption."""

    step: int = 0
    now: float = 1_000.0
    iteration: float = 2.0
    stall: float = 0.5
    duration: float = 6.0
    restart: float = 40.0
    preempt_at: tuple[int, ...] = (250,)
    cost_change_at: int = 300
    last_save_step: int | None = None
    last_save_time: float | None = None
    version: int = 0
    measured: bool = False
    pending: list[tuple[float, int, int]] = field(default_factory=list)
    notices: dict[int, float] = field(default_factory=dict)  # step -> window seconds
    notice: Notice | None = None

    def context(self) -> PolicyContext:
        m = self.measured
        return PolicyContext(
            step=self.step,
            now=self.now,
            last_save_step=self.last_save_step,
            last_save_time=self.last_save_time,
            iteration_time=self.iteration if m else None,
            save_stall=self.stall if m else None,
            save_duration=self.duration if m else None,
            restart_cost=None,
            preemption_rate=None,
            notice=self.notice,
            in_flight=len(self.pending),
        )

    def run(self, policy: IntervalPolicy, steps: int) -> list[Decision]:
        out = []
        for _ in range(steps):
            out.append(self.one(policy))
        return out

    def one(self, policy: IntervalPolicy) -> Decision:
        if self.step in self.notices:
            window = self.notices[self.step]
            self.notice = Notice(self.now, self.now + window, "test")
        d = policy.decide(self.context())
        assert isinstance(d, Decision), f"decide() returned {type(d).__name__}, not Decision"
        if d.save:
            self.version += 1
            self.pending.append((self.now + self.duration, self.version, self.step))
            self.last_save_step, self.last_save_time = self.step, self.now
            self.now += self.stall
        self.now += self.iteration * (1.0 + 0.2 * math.sin(self.step))
        self.step += 1
        for item in [p for p in self.pending if p[0] <= self.now]:
            self.pending.remove(item)
            policy.observe(SaveCompleted(item[1], item[2], item[0], self.stall, self.duration, 1))
            self.measured = True
        if self.step == self.cost_change_at:
            self.stall, self.duration = self.stall * 4, self.duration * 4
        if self.step in self.preempt_at:
            policy.observe(Preempted(self.now, self.step - (self.last_save_step or 0)))
            self.pending.clear()
            self.now += self.restart
            self.step = self.last_save_step or 0
            self.notice = None
            policy.observe(Restarted(self.now, self.restart, self.step))
        return d


class IntervalPolicyConformance(_Kit):
    """Generic tests for an :class:`~pcframe.policies.base.IntervalPolicy`."""

    expects_periodic_saves: ClassVar[bool] = True
    steps: ClassVar[int] = 600

    def driver(self) -> IntervalDriver:
        return IntervalDriver()

    def test_is_an_interval_policy_with_a_name(self) -> None:
        policy = self.make()
        assert isinstance(policy, IntervalPolicy)
        assert isinstance(policy.name, str) and policy.name, "set a class attribute `name`"

    def test_decide_returns_decisions(self) -> None:
        for d in self.driver().run(self.make(), self.steps):
            assert isinstance(d.save, bool) and isinstance(d.emergency, bool)
            assert isinstance(d.reason, str)

    def test_never_raises_on_missing_measurements(self) -> None:
        policy = self.make()
        for step, now in [(0, 0.0), (1, 0.0), (2, 1e-9), (3, 5.0), (10, 1e6)]:
            assert isinstance(policy.decide(PolicyContext(step=step, now=now)), Decision)
        ctx = PolicyContext(step=11, now=2e6, last_save_step=None, last_save_time=3e6)
        assert isinstance(policy.decide(ctx), Decision)  # a last save "in the future"

    def test_deterministic_for_equal_input(self) -> None:
        a = self.driver().run(self.make(), self.steps)
        b = self.driver().run(self.make(), self.steps)
        assert a == b

    def test_observe_accepts_every_event_type(self) -> None:
        policy = self.make()
        policy.decide(PolicyContext(step=1, now=10.0))
        for event in (
            SaveCompleted(version=1, step=1, time=11.0, stall=0.0, duration=0.0, nbytes=0),
            SaveCompleted(version=2, step=2, time=12.0, stall=3.0, duration=1e5, nbytes=1 << 40),
            Preempted(time=13.0),
            Preempted(time=13.5, lost_steps=7),
            Restarted(time=20.0, restart_cost=0.0),
            Restarted(time=30.0, restart_cost=120.0, step=2),
        ):
            policy.observe(event)
        assert isinstance(policy.decide(PolicyContext(step=3, now=31.0)), Decision)

    def test_state_dict_is_json(self) -> None:
        policy = self.make()
        json_round_trip(policy.state_dict())
        self.driver().run(policy, self.steps)
        json_round_trip(policy.state_dict())

    def test_state_round_trip_restores_behaviour(self) -> None:
        a, drv = self.make(), self.driver()
        drv.run(a, self.steps // 2)
        b = self.make()
        b.load_state_dict(json_round_trip(a.state_dict()))
        drv_b = copy.deepcopy(drv)
        assert drv.run(a, self.steps // 2) == drv_b.run(b, self.steps // 2)

    def test_load_state_dict_tolerates_missing_keys(self) -> None:
        policy = self.make()
        policy.load_state_dict({})  # state written by an older version of the policy
        assert isinstance(policy.decide(PolicyContext(step=1, now=1.0)), Decision)

    def test_no_emergency_without_a_notice(self) -> None:
        assert not any(d.emergency for d in self.driver().run(self.make(), self.steps))

    def test_saves_periodically(self) -> None:
        if not self.expects_periodic_saves:
            pytest.skip("policy declares it does not save periodically")
        saves = sum(d.save for d in self.driver().run(self.make(), self.steps))
        assert 1 <= saves < self.steps, f"{saves} saves in {self.steps} steps"

    def test_decide_is_cheap(self) -> None:
        policy, drv = self.make(), self.driver()
        start = time.perf_counter()
        drv.run(policy, 2000)
        per_call = (time.perf_counter() - start) / 2000
        assert per_call < 2e-3, f"decide() took {per_call * 1e3:.2f} ms per step"


# --- placement policies ---------------------------------------------------------------------


class PlacementPolicyConformance(_Kit):
    """Generic tests for a :class:`~pcframe.policies.placement.PlacementPolicy`."""

    versions: ClassVar[int] = 40
    notice_at: ClassVar[tuple[int, ...]] = (17, 31)

    def _run(
        self,
        policy: PlacementPolicy,
        start: int = 1,
        stop: int | None = None,
        committed: dict[str, list[int]] | None = None,
    ) -> tuple[list[PlacementDecision], dict[str, list[int]]]:
        tiers = policy.tiers
        committed = committed if committed is not None else {t: [] for t in tiers}
        out = []
        for v in range(start, (stop or self.versions) + 1):
            times = {t: 0.5 * (i + 1) ** 2 * (1 + (v % 3)) for i, t in enumerate(tiers)}
            notice = Notice(v * 10.0, v * 10.0 + 12.0, "test") if v in self.notice_at else None
            ctx = PlacementContext(
                v, v * 100, v * 10.0, times, {t: tuple(vs) for t, vs in committed.items()}, notice
            )
            d = policy.place(ctx)
            self._check(policy, ctx, d)
            out.append(d)
            for t in d.tiers:  # the engine commits, then applies retention
                committed[t].append(v)
                committed[t] = [x for x in committed[t] if x in d.keep.get(t, committed[t])]
        return out, committed

    @staticmethod
    def _check(policy: PlacementPolicy, ctx: PlacementContext, d: PlacementDecision) -> None:
        assert isinstance(d, PlacementDecision)
        assert d.tiers, "a version must go to at least one tier"
        assert set(d.tiers) <= set(policy.tiers), f"unknown tier in {d.tiers}"
        assert len(set(d.tiers)) == len(d.tiers), f"tier listed twice in {d.tiers}"
        assert set(d.keep) <= set(policy.tiers)
        for tier, keep in d.keep.items():
            have = set(ctx.committed.get(tier, ()))
            assert set(keep) <= have | {ctx.version}, f"{tier}: keeps versions it never had"
            if tier in d.tiers:
                assert ctx.version in keep, f"{tier}: retention would delete the new version"
            elif have:
                assert max(have) in keep, f"{tier}: retention would delete the newest version"

    def test_has_name_and_tiers(self) -> None:
        policy = self.make()
        assert isinstance(policy, PlacementPolicy)
        assert isinstance(policy.name, str) and policy.name
        assert policy.tiers and all(isinstance(t, str) and t for t in policy.tiers)

    def test_decisions_are_valid_over_a_run(self) -> None:
        self._run(self.make())

    def test_never_raises_without_estimates(self) -> None:
        policy = self.make()
        for notice in (None, Notice(0.0, 1.0)):
            d = policy.place(PlacementContext(version=1, step=1, now=0.0, notice=notice))
            self._check(policy, PlacementContext(1, 1, 0.0), d)

    def test_deterministic_for_equal_input(self) -> None:
        assert self._run(self.make())[0] == self._run(self.make())[0]

    def test_state_round_trip_restores_behaviour(self) -> None:
        a = self.make()
        half = self.versions // 2
        _, committed = self._run(a, 1, half)
        b = self.make()
        b.load_state_dict(json_round_trip(a.state_dict()))
        rest_a, _ = self._run(a, half + 1, None, copy.deepcopy(committed))
        rest_b, _ = self._run(b, half + 1, None, copy.deepcopy(committed))
        assert rest_a == rest_b

    def test_load_state_dict_tolerates_missing_keys(self) -> None:
        policy = self.make()
        policy.load_state_dict({})
        self._run(policy, 1, 3)


# --- resource policies ----------------------------------------------------------------------


class ResourcePolicyConformance(_Kit):
    """Generic tests for a :class:`~pcframe.policies.resource.ResourcePolicy`."""

    ticks: ClassVar[int] = 200

    def contexts(self) -> list[ResourceContext]:
        out = []
        for i in range(self.ticks):
            a = 0.5 + 0.45 * math.sin(i / 9.0)
            est = None if i % 17 == 0 else Estimate(a, max(a - 0.1, 0.0), min(a + 0.1, 1.0))
            out.append(
                ResourceContext(
                    now=i * 600.0,
                    work_done=i * 300.0,
                    work_total=100 * 600.0,
                    deadline=self.ticks * 600.0,
                    availability=est,
                    preemption_rate=Estimate(1e-4, 5e-5, 2e-4),
                    spot_available=i % 5 != 0,
                    spot_price=1.0,
                    on_demand_price=3.0,
                    changeover=300.0,
                )
            )
        return out

    def _run(self, policy: ResourcePolicy, ctxs: list[ResourceContext]) -> list[ResourceDecision]:
        out = []
        for ctx in ctxs:
            d = policy.decide(ctx)
            assert isinstance(d, ResourceDecision)
            assert isinstance(d.spot, int) and isinstance(d.on_demand, int)
            assert d.spot >= 0 and d.on_demand >= 0
            out.append(d)
        return out

    def test_has_name(self) -> None:
        policy = self.make()
        assert isinstance(policy, ResourcePolicy)
        assert isinstance(policy.name, str) and policy.name

    def test_never_raises_on_missing_inputs(self) -> None:
        self._run(self.make(), [ResourceContext(now=0.0), ResourceContext(now=1.0)])

    def test_deterministic_for_equal_input(self) -> None:
        ctxs = self.contexts()
        assert self._run(self.make(), ctxs) == self._run(self.make(), ctxs)

    def test_state_round_trip_restores_behaviour(self) -> None:
        ctxs = self.contexts()
        half = len(ctxs) // 2
        a = self.make()
        self._run(a, ctxs[:half])
        b = self.make()
        b.load_state_dict(json_round_trip(a.state_dict()))
        assert self._run(a, ctxs[half:]) == self._run(b, ctxs[half:])

    def test_load_state_dict_tolerates_missing_keys(self) -> None:
        policy = self.make()
        policy.load_state_dict({})
        self._run(policy, self.contexts()[:3])


# --- predictors -----------------------------------------------------------------------------


class PredictorConformance(_Kit):
    """Generic tests for a :class:`~pcframe.policies.predictors.Predictor`.

    Times are unix seconds (predictors may use the time of day).
    """

    learns_online: ClassVar[bool] = True
    t0: ClassVar[float] = 1_700_000_000.0

    def feed(self, p: Predictor, start: float, hours: int, preempt_every: int = 0) -> None:
        """``hours`` of exposure in 10-minute steps, a preemption every n steps (0: none)."""
        t = start
        for i in range(hours * 6):
            t += 600.0
            p.advance(t)
            p.observe_capacity(t, (i % 4), 3)
            if preempt_every and i % preempt_every == preempt_every - 1:
                p.observe(Preempted(t))
                t += 120.0
                p.observe(Restarted(t, 120.0))

    @staticmethod
    def _check(pred: Prediction) -> None:
        assert isinstance(pred, Prediction)
        for est in (pred.rate, pred.availability):
            if est is None:
                continue
            assert isinstance(est, Estimate)
            assert est.lower <= est.value <= est.upper
            assert 0.0 < est.confidence < 1.0
        assert pred.rate.value >= 0.0 and pred.rate.lower >= 0.0
        if pred.availability is not None:
            a = pred.availability
            assert 0.0 <= a.lower <= a.value <= a.upper <= 1.0

    def test_has_name(self) -> None:
        p = self.make()
        assert isinstance(p, Predictor)
        assert isinstance(p.name, str) and p.name

    def test_predicts_without_any_data(self) -> None:
        p = self.make()
        self._check(p.predict())
        self._check(p.predict(self.t0))

    def test_predictions_are_valid_over_a_run(self) -> None:
        p = self.make()
        self.feed(p, self.t0, 24, preempt_every=7)
        for h in range(0, 48, 5):
            self._check(p.predict(self.t0 + h * 3600.0))
        self._check(p.predict())

    def test_observe_accepts_every_event_type(self) -> None:
        p = self.make()
        p.observe(SaveCompleted(1, 1, self.t0, 0.1, 1.0, 10))
        p.observe(Restarted(self.t0 + 1, 10.0))
        p.observe(Preempted(self.t0 + 2))
        p.observe(Preempted(self.t0 + 3, lost_steps=3))
        self._check(p.predict(self.t0 + 4))

    def test_deterministic_for_equal_input(self) -> None:
        a, b = self.make(), self.make()
        for p in (a, b):
            self.feed(p, self.t0, 12, preempt_every=5)
        assert a.predict(self.t0 + 50_000) == b.predict(self.t0 + 50_000)

    def test_state_round_trip_restores_behaviour(self) -> None:
        a = self.make()
        self.feed(a, self.t0, 12, preempt_every=5)
        b = self.make()
        b.load_state_dict(json_round_trip(a.state_dict()))
        t1 = self.t0 + 12 * 3600.0 + 5000.0
        for p in (a, b):
            self.feed(p, t1, 6, preempt_every=4)
        t2 = t1 + 7 * 3600.0
        assert a.predict(t2) == b.predict(t2)

    def test_load_state_dict_tolerates_missing_keys(self) -> None:
        p = self.make()
        p.load_state_dict({})
        self._check(p.predict(self.t0))

    def test_rate_rises_with_own_preemptions(self) -> None:
        if not self.learns_online:
            pytest.skip("predictor declares it does not learn from the job's own events")
        calm, stormy = self.make(), self.make()
        self.feed(calm, self.t0, 6)
        self.feed(stormy, self.t0, 6, preempt_every=2)
        t = self.t0 + 7 * 3600.0
        assert stormy.predict(t).rate.value > calm.predict(t).rate.value
