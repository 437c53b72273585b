"""Resource policies: hybrid by predicted availability, and Can't Be Late's uniform progress."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import pcframe.policies as P
from pcframe.policies import Estimate, ResourceContext
from pcframe.policies.traces import load_trace


def avail(a: float, half: float = 0.05) -> Estimate:
    return Estimate(a, max(a - half, 0.0), min(a + half, 1.0))


def test_baselines() -> None:
    assert P.SpotOnly(3).decide(ResourceContext(now=0.0)).mode == "spot"
    d = P.OnDemandOnly(2).decide(ResourceContext(now=0.0))
    assert (d.on_demand, d.spot, d.mode) == (2, 0, "on_demand")


def test_hybrid_switches_with_hysteresis_and_scales_out() -> None:
    p = P.HybridAvailability(low=0.3, high=0.7, base_vms=1, max_spot_vms=4)
    seq = [0.9, 0.5, 0.2, 0.5, 0.69, 0.71, 1.0]
    modes = [p.decide(ResourceContext(now=i, availability=avail(a))) for i, a in enumerate(seq)]
    assert [d.mode for d in modes] == [
        "spot",
        "spot",
        "on_demand",
        "on_demand",
        "on_demand",
        "spot",
        "spot",
    ]
    assert modes[-1].spot == 4  # full availability: scale out to the maximum
    assert modes[0].spot == 3 and modes[5].spot == 1  # 1 + floor((a - 0.7) / 0.3 * 3)


def test_hybrid_pessimistic_and_dwell() -> None:
    p = P.HybridAvailability(pessimistic=True, min_dwell=100.0)
    # point estimate 0.75 > high, but the interval's low end 0.55 is not: stay where we are
    assert p.decide(ResourceContext(now=0.0, availability=avail(0.75, 0.2))).mode == "spot"
    assert p.decide(ResourceContext(now=10.0, availability=avail(0.1))).mode == "spot"  # dwell
    assert p.decide(ResourceContext(now=150.0, availability=avail(0.1))).mode == "on_demand"


def ctx(now: float, done: float, spot: bool, **kw: float) -> ResourceContext:
    return ResourceContext(
        now=now,
        work_done=done,
        work_total=100.0,
        deadline=200.0,
        spot_available=spot,
        changeover=5.0,
        **kw,
    )


def test_uniform_progress_rules() -> None:
    p = P.UniformProgress()
    assert p.decide(ctx(10.0, 20.0, True)).mode == "spot"
    assert p.decide(ctx(20.0, 20.0, False)).mode == "idle"  # ahead of 10: wait for spot
    assert p.decide(ctx(60.0, 25.0, False)).mode == "on_demand"  # behind 30: on-demand
    # back on spot only with a lead of 2 x changeover = 10
    assert p.decide(ctx(70.0, 40.0, True)).mode == "on_demand"  # lead 5
    assert p.decide(ctx(80.0, 51.0, True)).mode == "spot"  # lead 11
    # safety net: slack = (200 - 185) - (100 - 95) = 10 <= 2 x 5: on-demand to the end
    assert p.decide(ctx(185.0, 95.0, True)).mode == "on_demand"
    assert p.decide(ctx(186.0, 96.0, True)).mode == "on_demand"


def simulate(
    policy: P.ResourcePolicy,
    up: np.ndarray,
    step: float,
    work: float,
    deadline: float,
    changeover: float,
) -> tuple[float, float, float]:
    """Tiny spot/on-demand simulator: returns (finish time, spot hours, on-demand hours)."""
    done, mode, spot_h, od_h = 0.0, "idle", 0.0, 0.0
    for i in range(int(deadline / step) + 1):
        now = i * step
        if done >= work:
            return now, spot_h, od_h
        d = policy.decide(
            ResourceContext(
                now=now,
                work_done=done,
                work_total=work,
                deadline=deadline,
                spot_available=bool(up[i % up.size]),
                changeover=changeover,
            )
        )
        gain = step
        if d.mode != mode and d.mode != "idle":
            gain -= changeover  # a switch costs a restart
        mode = d.mode if d.mode != "idle" else mode
        if d.mode == "on_demand":
            od_h += step / 3600
            done += max(gain, 0.0)
        elif d.mode == "spot" and up[i % up.size]:
            spot_h += step / 3600
            done += max(gain, 0.0)
    return float("inf"), spot_h, od_h


def test_uniform_progress_meets_deadlines_on_real_traces(traces_dir) -> None:  # type: ignore[no-untyped-def]
    folder = traces_dir / "skynomad" / "aws-v100-availability-2023"
    for path in sorted(folder.glob("*.csv")):
        t = load_trace(path)
        work, deadline = 48 * 3600.0, 72 * 3600.0
        finish, spot_h, od_h = simulate(
            P.UniformProgress(changeover=600.0), t.up, t.step_seconds, work, deadline, 600.0
        )
        assert finish <= deadline, path.name
        spot_only, _, _ = simulate(P.SpotOnly(), t.up, t.step_seconds, work, deadline, 600.0)
        if spot_only > deadline:
            assert od_h > 0  # it needed on-demand where spot alone misses the deadline
        if t.availability() > 0.85:
            assert spot_h > od_h  # a good zone runs mostly on spot


def test_uniform_progress_without_deadline_is_spot() -> None:
    assert P.UniformProgress().decide(ResourceContext(now=0.0)).mode == "spot"
    with pytest.raises(ValueError):
        P.ResourceDecision(spot=-1)


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: P.SpotOnly(vms=math.nan), "vms=nan"),
        (lambda: P.OnDemandOnly(vms=1.5), "vms=1.5"),
        (lambda: P.UniformProgress(vms=math.nan), "vms=nan"),
        (lambda: P.UniformProgress(changeover=math.nan), "changeover=nan"),
        (lambda: P.UniformProgress(safety_factor=math.nan), "safety_factor=nan"),
        (lambda: P.HybridAvailability(base_vms=math.nan), "base_vms=nan"),
        (lambda: P.HybridAvailability(max_spot_vms=2.5), "max_spot_vms=2.5"),
        (lambda: P.HybridAvailability(min_dwell=math.nan), "min_dwell=nan"),
    ],
)
def test_resource_arguments_are_checked_when_made(make, key) -> None:
    """NaN passed the '< 1' and '< 0' checks: vms=nan failed at the first decision with
    'VM counts must be whole numbers', naming no key; a NaN changeover or safety factor
    silently turned UniformProgress's safety net off (slack <= nan is never true)."""
    with pytest.raises(ValueError, match=re.escape(key)):
        make()
