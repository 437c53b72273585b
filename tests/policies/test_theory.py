"""Interval closed forms against published values, and Daly's optimum by Monte Carlo."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pcframe.policies.theory import (
    daly_expected_walltime,
    daly_interval_exact,
    daly_interval_series,
    young_interval,
    young_waste_fraction,
)

C, M = 300.0, 3600.0


def test_published_values() -> None:
    # REFERENCES.md §3: C = 300 s, M = 3600 s -> Young 1469.7 s, Daly 1276.5 s, exact 1276.9 s.
    assert young_interval(C, M) == pytest.approx(1469.7, abs=0.05)
    assert daly_interval_series(C, M) == pytest.approx(1276.5, abs=0.05)
    assert daly_interval_exact(C, M) == pytest.approx(1276.9, abs=0.05)


def test_exact_optimum_is_a_stationary_point_of_the_expected_walltime() -> None:
    tau = daly_interval_exact(C, M)
    f = lambda t: daly_expected_walltime(t, C, M, restart=60.0, work=1.0)  # noqa: E731
    h = 1e-3 * tau
    assert abs(f(tau + h) - f(tau - h)) / (2 * h) < 1e-9
    assert f(tau) < f(0.9 * tau) and f(tau) < f(1.1 * tau)
    # the Lambert-W root also satisfies the first-order condition exactly
    assert daly_interval_exact(C, M) < young_interval(C, M)


def test_exact_solver_matches_lambert_w() -> None:
    from scipy.special import lambertw  # the slow, obviously correct reference

    for c in np.geomspace(1e-4, 50.0, 400):
        ref = 1.0 + lambertw(-math.exp(-1.0 - c), 0).real
        assert daly_interval_exact(c, 1.0) == pytest.approx(ref, rel=1e-9), c
    # Nearer the branch point lambertw itself loses digits (1 + e·x cancels); there the
    # expansion W₀ = −1 + p − p²/3 + 11p³/72 − 43p⁴/540, p = √(2(1 − e^(−c))), is the reference.
    for c in np.geomspace(1e-12, 1e-6, 50):
        p = math.sqrt(-2.0 * math.expm1(-c))
        ref = p - p**2 / 3 + 11 * p**3 / 72 - 43 * p**4 / 540
        assert daly_interval_exact(c, 1.0) == pytest.approx(ref, rel=1e-9), c


def test_exact_solver_is_cheap() -> None:
    import time

    start = time.process_time()  # CPU time: other work on a busy machine does not count
    for i in range(2000):
        daly_interval_exact(1.0 + i, 3600.0)
    assert (time.process_time() - start) / 2000 < 2e-4  # well under 200 µs of CPU per call


def test_edges() -> None:
    assert daly_interval_series(3 * M, M) == M  # the series is only valid for C < 2M
    assert daly_interval_exact(0.0, M) == 0.0
    # A subnormal cost (a stall estimate decayed towards 0): √(2c) underflowed to 0 and the
    # Newton step divided by it (ZeroDivisionError inside simulate()).
    assert daly_interval_exact(1e-323, M) == pytest.approx(young_interval(1e-323, M))
    assert math.isinf(daly_interval_exact(C, math.inf))
    assert daly_expected_walltime(100.0, 10.0, math.inf, work=1000.0) == pytest.approx(1100.0)
    assert young_waste_fraction(young_interval(C, M), C, M) == pytest.approx(math.sqrt(2 * C / M))
    for bad in ((-1.0, M), (C, 0.0), (math.nan, M)):
        with pytest.raises(ValueError, match="must be"):
            young_interval(*bad)
    with pytest.raises(ValueError, match="tau"):
        daly_expected_walltime(0.0, C, M)


def simulate_walltime(
    tau: float, cost: float, mtbf: float, restart: float, work: float, runs: int, seed: int
) -> np.ndarray:
    """Wall time of ``runs`` jobs of ``work`` seconds under Poisson failures (vectorised).

    Each segment is ``tau`` of work then a checkpoint of ``cost``; a failure anywhere loses
    the segment and costs a restart of ``restart`` seconds (which can itself fail).
    """
    rng = np.random.default_rng(seed)
    done = np.zeros(runs)
    wall = np.zeros(runs)
    while (active := done < work - 1e-9).any():
        idx = np.flatnonzero(active)
        seg = np.minimum(tau, work - done[idx])
        length = seg + cost
        x = rng.exponential(mtbf, idx.size)
        ok = x >= length
        wall[idx[ok]] += length[ok]
        done[idx[ok]] += seg[ok]
        failed = idx[~ok]
        wall[failed] += x[~ok]
        while failed.size:  # restart until one restart survives
            y = rng.exponential(mtbf, failed.size)
            good = y >= restart
            wall[failed[good]] += restart
            wall[failed[~good]] += y[~good]
            failed = failed[~good]
    return wall


@pytest.mark.slow
def test_daly_optimum_minimises_simulated_walltime() -> None:
    restart, work, runs = 60.0, 50 * 3600.0, 4000
    tau = daly_interval_exact(C, M)
    means = {}
    for k, factor in enumerate((0.5, 1.0, 2.0)):
        wall = simulate_walltime(factor * tau, C, M, restart, work, runs, seed=1234 + k)
        se = wall.std(ddof=1) / math.sqrt(runs)
        means[factor] = (wall.mean(), se)
    best, best_se = means[1.0]
    # The model: the simulation agrees with Daly's closed form within 1 %...
    assert best == pytest.approx(daly_expected_walltime(tau, C, M, restart, work), rel=0.01)
    # ...and the optimum beats half and double the interval by many standard errors
    # (analytically by ~8 % and ~10 %; the standard error here is ~0.3 %).
    for factor in (0.5, 2.0):
        mean, se = means[factor]
        assert mean - best > 5 * math.hypot(se, best_se), (factor, means)
        assert mean / best > 1.04


def test_a_free_checkpoint_with_no_failures_is_never_taken_not_nan():
    """0 * inf is NaN: Young asked for a NaN interval (a free save, no preemption seen),
    which the engine refuses as not a number."""
    from pcframe.policies import PolicyContext, Young
    from pcframe.policies.theory import young_interval

    assert young_interval(0.0, math.inf) == math.inf
    assert young_interval(0.0, 3600.0) == 0.0
    assert not Young(mtbf=math.inf, stall_prior=0.0).decide(PolicyContext(step=1, now=5.0)).save
