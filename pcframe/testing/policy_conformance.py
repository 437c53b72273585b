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
import math
from typing import ClassVar

import pytest

from pcframe.policies.base import Notice, Preempted, Restarted, SaveCompleted
from pcframe.policies.placement.base import (
    PlacementContext,
    PlacementDecision,
    PlacementPolicy,
    checked_placement,
)
from pcframe.policies.predictors.base import Estimate, Prediction, Predictor
from pcframe.policies.resource.base import (
    ResourceContext,
    ResourceDecision,
    ResourcePolicy,
    checked_resource_decision,
)
from pcframe.testing.interval_conformance import IntervalDriver, IntervalPolicyConformance
from pcframe.testing.kit import Kit, json_round_trip

__all__ = [  # the interval kit lives in pcframe.testing.interval_conformance
    "IntervalDriver",
    "IntervalPolicyConformance",
    "PlacementPolicyConformance",
    "PredictorConformance",
    "ResourcePolicyConformance",
]


# --- placement policies ---------------------------------------------------------------------


class PlacementPolicyConformance(Kit):
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
        checked_placement(policy, d, policy.tiers, ctx.version)  # as the engine checks it
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


class ResourcePolicyConformance(Kit):
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
            d = checked_resource_decision(policy, policy.decide(ctx))  # as the simulator does
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


class PredictorConformance(Kit):
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
