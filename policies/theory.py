"""Closed forms of checkpoint-interval theory (Young 1974, Daly 2006).

Notation as in the literature: ``cost`` C = seconds of training lost to one checkpoint,
``mtbf`` M = mean time between failures, ``restart`` R = seconds from failure to training
resumed, ``tau`` = seconds of useful work between two checkpoints. All functions are pure so
that policies, the simulator and the tests share one definition.
"""

from __future__ import annotations

import math


def _check(cost: float, mtbf: float) -> None:
    if not (cost >= 0.0 and math.isfinite(cost)):
        raise ValueError(f"checkpoint cost C={cost!r} must be a finite number >= 0 seconds")
    if not (mtbf > 0.0):
        raise ValueError(f"MTBF M={mtbf!r} must be > 0 seconds (use math.inf for no failures)")


def young_interval(cost: float, mtbf: float) -> float:
    """Young's first-order optimum τ = √(2·C·M); never with no failures (M = inf), even for
    a free checkpoint (C = 0: 0·inf is NaN)."""
    _check(cost, mtbf)
    if math.isinf(mtbf):
        return math.inf
    return math.sqrt(2.0 * cost) * math.sqrt(mtbf)  # not √(2CM): 2CM overflows near 1e308


def daly_interval_series(cost: float, mtbf: float) -> float:
    """Daly's higher-order series optimum; τ = M when C >= 2M (the series diverges there)."""
    _check(cost, mtbf)
    if math.isinf(mtbf):
        return math.inf
    if cost >= 2.0 * mtbf:
        return mtbf
    x = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost


def daly_interval_exact(cost: float, mtbf: float) -> float:
    """Exact minimiser of Daly's expected wall time: τ* = M·(1 + W₀(−e^(−1−C/M))).

    Policies call this every step, and scipy's ``lambertw`` costs ~100 µs a call, so the
    equivalent optimality condition is solved directly: with u = τ/M and c = C/M, dT_w/dτ = 0
    is h(u) = u + c + log(1 − u) = 0, one root in (0, 1). h is concave and decreasing there,
    so Newton from Young's guess √(2c) (right of the root) descends monotonically onto it;
    bisection guards the steps near u = 1. The tests compare it with ``lambertw``.
    """
    _check(cost, mtbf)
    if math.isinf(mtbf):
        return math.inf
    if cost == 0.0:
        return 0.0
    c = cost / mtbf
    lo, hi = 0.0, 1.0
    u = min(math.sqrt(2.0 * c), 1.0 - 1e-9)
    if u == 0.0:  # c underflowed (a subnormal stall estimate): Young's value is exact here
        return math.sqrt(2.0 * cost) * math.sqrt(mtbf)
    for _ in range(200):
        h = u + c + math.log1p(-u)
        if h > 0.0:
            lo = u
        else:
            hi = u
        step = h * (1.0 - u) / u  # h / h'(u), h'(u) = −u / (1 − u)
        if abs(step) <= 1e-15 * u:
            # Converged. Tested before the bracket: at an exact root (h == 0) the Newton
            # point equals a bracket end, and bisecting from there took ~40 more rounds.
            u += step
            break
        nxt = u + step
        if not lo < nxt < hi:
            nxt = 0.5 * (lo + hi)
        if abs(nxt - u) <= 1e-15 * u:
            u = nxt
            break
        u = nxt
    return mtbf * u


def daly_expected_walltime(
    tau: float, cost: float, mtbf: float, restart: float = 0.0, work: float = 1.0
) -> float:
    """Daly's expected wall time to finish ``work`` seconds of compute with interval ``tau``.

    T_w(τ) = M · e^(R/M) · (e^((τ+C)/M) − 1) · work / τ. Failures may strike during work,
    checkpoint and restart alike; each costs the work since the last checkpoint.
    """
    _check(cost, mtbf)
    if tau <= 0.0:
        raise ValueError(f"interval tau={tau!r} must be > 0 seconds")
    if math.isinf(mtbf):
        return (tau + cost) * work / tau
    return mtbf * math.exp(restart / mtbf) * math.expm1((tau + cost) / mtbf) * work / tau


def young_waste_fraction(tau: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    """First-order fraction of wall time wasted: C/τ + (τ/2 + R)/M."""
    _check(cost, mtbf)
    if tau <= 0.0:
        raise ValueError(f"interval tau={tau!r} must be > 0 seconds")
    return cost / tau + (tau / 2.0 + restart) / mtbf
