"""The save schedule that keeps the most work over a whole life, by the VM's age.

When a VM dies is set by the zone, not by the job: a life's wall time is the same whatever
the job does, so goodput is the expected work a life *keeps* (what was durable before it
died) divided by a fixed mean life. With ``S`` the survival function of a life and saves
that block training ``stall`` s and are durable ``durable`` s after they start, the most
work a VM alive at age ``a`` (just after a save) can still keep obeys Bellman's equation

    V(a) = max_τ  τ · S(a + τ + durable) / S(a)  +  S(a + τ + stall) / S(a) · V(a + τ + stall)

(train ``τ``, save: the ``τ`` are kept if the VM lives until the save is durable, and the
next cycle starts at ``a + τ + stall`` if it is still alive then). For Poisson lives
``V`` is the same at every age and the optimum is exactly Daly's (``τ/M = 1 - e^{-(τ+C)/M}``
when stall = durable = C). For over-dispersed lives the hazard falls with age, and a save
early in a life is worth more than a ratio of one cycle says: what it protects is the start
of a life that, if it survives, lasts long. :func:`kept_work_schedule` solves the equation
on a log grid of ages by policy iteration; the policy reads the interval at its age from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pcframe.policies.predictors.lifetime import SHAPE_GRID

N_AGES = 96  # log grid of ages, 1e-3 to 200 mean lives, plus age 0
# Candidate τ at every age: these multiples of the local Young interval √(2·stall / h(a)).
_REL = np.geomspace(0.2, 5.0, 41)
_K = np.array(SHAPE_GRID)
_FINITE = np.isfinite(_K)
_KF = np.where(_FINITE, _K, 2.0)  # placeholder where Poisson; masked


def _log_survival(t: np.ndarray, mtbf: float, log_w: np.ndarray) -> np.ndarray:
    """log S(t) of the mixture of Lomax lives (mean ``mtbf``) with log weights ``log_w``."""
    t = t[..., None]
    lomax = -_KF * np.log1p(t / ((_KF - 1.0) * mtbf))
    per_shape = np.where(_FINITE, lomax, -t / mtbf) + log_w
    top = per_shape.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(per_shape - top).sum(axis=-1, keepdims=True)))[..., 0]


def kept_work_schedule(
    mtbf: float, stall: float, durable: float, weights: Sequence[float] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(ages, τ)``: seconds of training before the next save, for a VM alive at each age.

    Lives are a mixture over :data:`~.lifetime.SHAPE_GRID` with ``weights`` (Poisson if
    ``None``) and mean ``mtbf``. Ages beyond the grid are treated as Poisson at the hazard
    of the last one (the hazard is flat there). Costs ~2 ms; callers memoise.
    """
    if not (math.isfinite(mtbf) and mtbf > 0):
        return np.array([0.0, 1.0]), np.array([math.inf, math.inf])
    w = np.zeros(len(SHAPE_GRID)) if weights is None else np.asarray(weights, dtype=float)
    if weights is None:
        w[-1] = 1.0
    with np.errstate(divide="ignore"):
        log_w = np.log(w / w.sum())
    ages = np.concatenate([[0.0], np.geomspace(1e-3 * mtbf, 200.0 * mtbf, N_AGES - 1)])
    # Hazard of the mixture at each age: the shapes' hazards weighted by who is still alive.
    per = np.where(_FINITE, -_KF * np.log1p(ages[:, None] / ((_KF - 1.0) * mtbf)), 0.0)
    per = np.where(_FINITE, per, -ages[:, None] / mtbf) + log_w
    alive = np.exp(per - per.max(axis=1, keepdims=True))
    alive /= alive.sum(axis=1, keepdims=True)
    h_shape = np.where(_FINITE, _KF / ((_KF - 1.0) * mtbf + ages[:, None]), 1.0 / mtbf)
    hazard = (alive * h_shape).sum(axis=1)
    tau = np.sqrt(2.0 * max(stall, 1e-6 * mtbf) / hazard)[:, None] * _REL
    log_s = _log_survival(ages, mtbf, log_w)[:, None]
    keep = np.exp(_log_survival(ages[:, None] + tau + durable, mtbf, log_w) - log_s)
    nxt = ages[:, None] + tau + stall
    go = np.exp(_log_survival(nxt, mtbf, log_w) - log_s)
    gain = tau * keep
    # Beyond the last age: Poisson at its hazard, V = max τ e^{-h(τ+D)} / (1 - e^{-h(τ+S)}).
    h, last = hazard[-1], tau[-1]
    top = float(np.max(last * np.exp(-h * (last + durable)) / -np.expm1(-h * (last + stall))))
    j = np.searchsorted(ages, nxt, side="right") - 1  # nxt lies in [ages[j], ages[j+1])
    inside = j < N_AGES - 1
    j = np.minimum(j, N_AGES - 2)
    f = np.where(inside, (nxt - ages[j]) / (ages[j + 1] - ages[j]), 0.0)
    rows = np.arange(N_AGES)
    choice = np.full(N_AGES, int(np.argmin(np.abs(_REL - 1.0))))
    value = np.zeros(N_AGES)
    for _ in range(30):  # policy iteration: evaluate the schedule exactly, then improve it
        c = choice
        jc, fc, gc, inc = j[rows, c], f[rows, c], go[rows, c], inside[rows, c]
        a = np.eye(N_AGES)
        b = gain[rows, c] + np.where(inc, 0.0, gc * top)
        np.add.at(a, (rows, jc), -np.where(inc, gc * (1.0 - fc), 0.0))
        np.add.at(a, (rows, jc + 1), -np.where(inc, gc * fc, 0.0))
        a[-1], b[-1] = 0.0, top
        a[-1, -1] = 1.0
        value = np.linalg.solve(a, b)
        cont = np.where(inside, value[j] * (1.0 - f) + value[j + 1] * f, top)
        total = gain + go * cont
        best = np.argmax(total, axis=1)
        keep_old = total[rows, choice] >= total[rows, best] * (1.0 - 1e-12)
        new = np.where(keep_old, choice, best)
        if np.array_equal(new, choice):
            break
        choice = new
    return ages, _refine(tau, total, choice)


def _refine(tau: np.ndarray, total: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """The vertex of the parabola through the best candidate and its neighbours (in log τ)."""
    rows = np.arange(tau.shape[0])
    c = np.clip(choice, 1, tau.shape[1] - 2)
    y0, y1, y2 = total[rows, c - 1], total[rows, c], total[rows, c + 1]
    den = y0 - 2.0 * y1 + y2
    with np.errstate(divide="ignore", invalid="ignore"):
        shift = np.where(den < 0, 0.5 * (y0 - y2) / den, 0.0)
    shift = np.clip(np.nan_to_num(shift), -1.0, 1.0)
    step = math.log(_REL[1] / _REL[0])
    edge = (choice == 0) | (choice == tau.shape[1] - 1)
    return np.where(edge, tau[rows, choice], tau[rows, c] * np.exp(shift * step))
