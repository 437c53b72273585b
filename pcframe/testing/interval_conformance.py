"""The conformance kit of interval policies, and the small engine stand-in that drives them.

See :mod:`pcframe.testing.policy_conformance` for how plugin authors use the kits.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from pcframe.policies.base import (
    Decision,
    IntervalPolicy,
    Notice,
    PolicyContext,
    Preempted,
    Restarted,
    SaveCompleted,
    checked_decision,
)
from pcframe.testing.kit import Kit, json_round_trip


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
        d = checked_decision(policy, policy.decide(self.context()))  # as the engine does
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


class IntervalPolicyConformance(Kit):
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
        start = time.process_time()  # CPU time: other work on a busy machine does not count
        drv.run(policy, 2000)
        per_call = (time.process_time() - start) / 2000
        assert per_call < 2e-3, f"decide() took {per_call * 1e3:.2f} ms of CPU per step"

    def test_save_hint_is_exact(self) -> None:
        """The engine asks the policy at every step; the simulator only where its
        ``save_hint`` points (and fast-forwards steady runs of saves). A hint may come early,
        never late, and must name every point where an answer could change: otherwise the
        simulator ranks the policy on decisions the engine never takes."""
        from pcframe.sim import JobSpec, SimOptions, poisson_trace, simulate

        trace = poisson_trace(mtbf=7200.0, hours=12.0, outage=900.0, seed=4)
        job = JobSpec(iteration_time=2.0, save_stall=6.0, save_duration=180.0, restart_cost=600.0)
        paths = {"every step": {"use_hints": False}, "hinted": {"fast_forward": False}, "fast": {}}
        saves = {
            path: simulate(
                trace, self.make(), job, options=SimOptions(record_saves=True, **options)
            ).save_steps
            for path, options in paths.items()
        }
        for path in ("hinted", "fast"):
            assert saves[path] == saves["every step"], (
                f"{path} path: saves at other steps than asking every step; "
                "save_hint() came too late or missed a point where decide() changes"
            )
