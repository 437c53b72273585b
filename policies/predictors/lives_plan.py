"""PA's ``lives`` schedule: the best cycle at the VM's age under the lives this job has seen.

The ``cycle`` schedule (:func:`~.lifetime.cycle_interval`) takes the survival ``S`` of a
life from a parametric model: a Lomax mixture at the learned mean life. Zones need not be
Lomax, and the best fixed interval in hindsight is set by the trace's actual lives. Here
``S`` is :class:`LifeBlend`: the job's own lives (each only known to have ended between two
ages) blended with that prediction as a Dirichlet-process posterior blends data with its
base measure: the prediction counts as ``prior_lives`` lives (what the rate prior is worth
in preemptions), each observed life as one. Planning at age ``a`` conditions the blend on
``life > a``: the lives seen that ended sooner drop out, so past the longest of them only
the prediction is left, and a run of short lives does not hide that this VM has already
outlived them. The interval is then the best ratio of one cycle at the VM's age,

    g(τ) = τ · S(a + τ + durable) / ∫₀^{τ+stall} S(a + u) du,

the ``cycle`` objective with the blended ``S`` (with no lives it is the ``cycle`` schedule;
for Poisson lives Daly's optimum). Experiment 5 measures it against ``cycle``
(``experiments/results/sim_exp5_loo_hindsight.md``, variant ``PA lives``).

Lives that end while the job restores never trained: whatever the interval, they keep no
work, so they carry no information about the interval and are not part of ``S``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from pcframe.policies.predictors.lifetime import SHAPE_GRID

_K = np.array(SHAPE_GRID)
_FINITE = np.isfinite(_K)
_KF = np.where(_FINITE, _K, 2.0)  # placeholder where Poisson; masked
# Search grid of τ in log space: coarse over the whole range, then between the best point's
# neighbours (steps of well under 1 %, far below the policy's hysteresis).
_COARSE = np.linspace(0.0, 1.0, 96)
_FINE = np.linspace(0.0, 1.0, 25)


class EmpiricalLives:
    """Σ_i r_i(t): how many of the job's lives were still running at age ``t``.

    A life is only known to have ended between two ages ``lo`` and ``hi`` (alive at its
    last checkpoint, dead before the next was durable), so ``r_i`` falls from 1 at ``lo`` to
    0 at ``hi``. How it falls in between is the prediction's conditional survival within
    that window (``shape``: a survival function of age; linear when ``None``), as one step
    of Turnbull's self-consistent estimator would spread it. Spreading evenly would not do:
    the window is one of the policy's own intervals long, so lives would look longer
    the longer the policy's intervals were, and longer intervals would follow. The sum is
    kept piecewise linear on a few points per window, so it and its tail integral are
    read off by interpolation."""

    POINTS = 9  # per window

    def __init__(
        self,
        lives: Sequence[tuple[float, float]],
        shape: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        lo = np.array([max(float(a), 0.0) for a, _ in lives])
        hi = np.array([float(b) for _, b in lives])
        hi = np.maximum(hi, lo + 1e-9)  # a point mass as a ramp too narrow to matter
        self.n = len(lives)
        if self.n == 0:
            self.xs = np.array([0.0, 1.0])
            self.ys = np.zeros(2)
            self.tail = np.zeros(2)
            return
        u = np.linspace(0.0, 1.0, self.POINTS)
        pts = lo[:, None] + (hi - lo)[:, None] * u[None, :]  # (n, POINTS)
        ramp = np.broadcast_to(1.0 - u, pts.shape)
        if shape is not None:
            s = shape(pts)
            drop = s[:, :1] - s[:, -1:]
            ok = drop > 1e-12 * np.maximum(s[:, :1], 1e-300)
            ramp = np.where(ok, (s - s[:, -1:]) / np.where(ok, drop, 1.0), ramp)
        xs = np.unique(np.concatenate([[0.0], pts.ravel()]))
        ys = np.zeros_like(xs)
        for p, r in zip(pts, ramp, strict=True):
            ys += np.interp(xs, p, r, left=1.0, right=0.0)
        # ∫_{x_j}^∞: trapezoids from the right (the sum is 0 beyond the last hi).
        seg = np.diff(xs) * (ys[:-1] + ys[1:]) / 2.0
        self.xs, self.ys = xs, ys
        self.tail = np.concatenate([np.cumsum(seg[::-1])[::-1], [0.0]])

    def survival(self, t: np.ndarray) -> np.ndarray:
        """How many of the lives were still running at age ``t`` (fractionally)."""
        return np.interp(t, self.xs, self.ys, left=float(self.n), right=0.0)

    def tail_integral(self, t: np.ndarray) -> np.ndarray:
        """∫_t^∞ of :meth:`survival` (``t >= 0``)."""
        t = np.asarray(t, dtype=float)
        j = np.clip(np.searchsorted(self.xs, t, side="right"), 1, self.xs.size - 1)
        inside = t < self.xs[-1]
        s = self.survival(t)
        part = (self.xs[j] - t) * (s + self.ys[j]) / 2.0 + self.tail[j]
        return np.where(inside, part, 0.0)


def prior_survival(mtbf: float, weights: Sequence[float]) -> Callable[[np.ndarray], np.ndarray]:
    """``S(t)`` of the prediction: the Lomax mixture with mean life ``mtbf``."""
    w = np.asarray(weights, dtype=float)
    sig = (_KF - 1.0) * mtbf

    def survival(t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=float)[..., None]
        per = np.where(_FINITE, (1.0 + t / sig) ** -_KF, np.exp(-t / mtbf))
        return (per * w).sum(axis=-1)

    return survival


class LifeBlend:
    """Survival of the life in progress at ``age``: the prior prediction (a Lomax mixture
    with mean life ``mtbf`` and shape weights ``weights`` over :data:`~.lifetime.SHAPE_GRID`,
    worth ``prior_lives`` lives) blended with the job's own ``lives``.

    Unnormalised: ``survival(u)`` is proportional to ``P(life > age + u | life > age)`` by a
    factor that does not depend on ``u``, which is all an argmax over ``τ`` needs.
    """

    def __init__(
        self,
        lives: EmpiricalLives,
        prior_lives: float,
        mtbf: float,
        weights: Sequence[float],
        age: float = 0.0,
    ) -> None:
        if not (math.isfinite(mtbf) and mtbf > 0):
            raise ValueError(f"mtbf={mtbf} must be a finite number of seconds > 0")
        self.lives, self.age, self.mtbf = lives, max(float(age), 0.0), float(mtbf)
        w = np.asarray(weights, dtype=float)
        sig = (_KF - 1.0) * mtbf
        # Each shape's survival to this age (the prior's mass still alive), and the shape
        # weights given that the life got here: old lives are more likely heavy-tailed ones.
        log_s = np.where(_FINITE, -_KF * np.log1p(self.age / sig), -self.age / mtbf)
        with np.errstate(divide="ignore"):
            log_ws = np.log(w) + log_s
        top = log_ws.max()
        s_age = math.exp(top) * float(np.exp(log_ws - top).sum())  # S_prior(age)
        self.cond_w = np.exp(log_ws - top)
        self.cond_w /= self.cond_w.sum()
        self.scale = sig + self.age  # a Lomax conditioned on age a is a Lomax of scale σ + a
        # The prior's lives still alive at this age. The life in progress adds nothing: a
        # life censored at ``age`` spreads beyond it as the blend itself does (Efron's
        # redistribution to the right), which leaves the blend given ``age`` unchanged.
        self.model_weight = prior_lives * s_age

    def _model(self, u: np.ndarray) -> np.ndarray:
        """The prediction's survival from ``age`` to ``age + u``, given alive at ``age``."""
        u = u[..., None]
        lomax = (1.0 + u / self.scale) ** -_KF
        per = np.where(_FINITE, lomax, np.exp(-u / self.mtbf))
        return (per * self.cond_w).sum(axis=-1)

    def _model_tail(self, u: np.ndarray) -> np.ndarray:
        """∫_u^∞ of :meth:`_model`: ``(σ+a)/(k-1)·(1 + u/(σ+a))^(1-k)`` per Lomax shape."""
        u = u[..., None]
        lomax = self.scale / (_KF - 1.0) * (1.0 + u / self.scale) ** (1.0 - _KF)
        per = np.where(_FINITE, lomax, self.mtbf * np.exp(-u / self.mtbf))
        return (per * self.cond_w).sum(axis=-1)

    def survival(self, u: np.ndarray) -> np.ndarray:
        return self.model_weight * self._model(u) + self.lives.survival(self.age + u)

    def tail_integral(self, u: np.ndarray) -> np.ndarray:
        return self.model_weight * self._model_tail(u) + self.lives.tail_integral(self.age + u)


def cycle_gain(blend: LifeBlend, tau: np.ndarray, stall: float, durable: float) -> np.ndarray:
    """Durable work per second of one cycle started now: ``τ`` kept if the life reaches the
    save's durability, over the wall time the life is expected to spend in the cycle."""
    tau = np.asarray(tau, dtype=float)
    kept = tau * blend.survival(tau + durable)
    spent = blend.tail_integral(np.zeros(1)) - blend.tail_integral(tau + stall)
    return kept / np.maximum(spent, 1e-300)


def lives_interval(blend: LifeBlend, stall: float, durable: float) -> float:
    """Seconds from one save's start to the next (``τ + stall``): the ``τ`` with the best
    :func:`cycle_gain` under ``blend`` (a coarse log grid, then between the best point's
    neighbours)."""
    m = blend.mtbf
    lo = math.log(1e-3 * min(m, 1.0 + stall))
    longest = blend.lives.xs[-1] if blend.lives.n else 0.0
    hi = math.log(100.0 * (m + 5.0 * blend.age) + 10.0 * (durable + longest))
    grid = np.exp(lo + (hi - lo) * _COARSE)
    i = int(np.argmax(cycle_gain(blend, grid, stall, durable)))
    a, b = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, grid.size - 1)])
    fine = np.exp(a + (b - a) * _FINE)
    best = fine[int(np.argmax(cycle_gain(blend, fine, stall, durable)))]
    return float(best + stall)
