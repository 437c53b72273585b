"""What historical traces say beyond one mean rate: how zones differ, and how lives age.

Two facts of spot traces that a single Poisson rate hides, both fitted here from history
(never from the job being planned):

* **Zones differ by orders of magnitude** (MTBF from minutes to weeks). A Gamma prior over
  a new zone's rate should be as wide as that spread, so a handful of the job's own
  preemptions outweigh it. :func:`rate_prior` fits the Gamma by matching the spread of the
  traces' log rates (empirical Bayes): ``Var[log λ] = ψ₁(α₀)`` for ``λ ~ Gamma(α₀, β₀)``.
* **Lives are over-dispersed**: most VMs die young, the survivors live long (coefficient of
  variation 1.5-4 on the shipped traces, 1 for a Poisson process). A Lomax (Pareto II)
  lifetime, ``S(a) = (1 + a/σ)^-k``, is the Poisson process whose rate differs from life to
  life (Gamma-distributed with shape ``k``); its hazard ``h(a) = k / (σ + a)`` falls with the
  age ``a`` of the VM. ``k`` is scale-free, so it transfers between zones with different
  MTBFs; the zone's own mean life sets ``σ = (k - 1) · MTBF``. :func:`shape_prior` turns
  the traces' fitted shapes into a prior over a grid of shapes, and
  :class:`LifeShapePosterior` updates it with the job's own lives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pcframe.policies.traces import Trace

# Shapes above this are indistinguishable from a Poisson process over a trace's lives.
POISSON_SHAPE = 50.0
# Below 1 the mean life is infinite and σ = (k - 1)·MTBF is undefined: the fit stops here.
MIN_SHAPE = 1.2
MIN_LIVES = 10  # fewer lives say nothing about their spread


def lives(trace: Trace) -> np.ndarray:
    """Seconds between consecutive preemptions while up: the lives a job on it would have.

    Availability traces (capacity 1): the lengths of the up runs. Count traces: the gaps
    between drops of the up-count (a data-parallel job on every VM dies at any drop).
    """
    up = np.asarray(trace.up)
    if trace.capacity == 1:
        on = np.concatenate([[0], (up > 0).astype(np.int8), [0]])
        edges = np.flatnonzero(np.diff(on))
        runs = edges[1::2] - edges[0::2]
        # The last run is cut by the end of the trace, not by a preemption.
        if up.size and up[-1] > 0:
            runs = runs[:-1]
        return runs.astype(float) * trace.step_seconds
    ticks = trace.preemption_ticks()
    return np.diff(ticks).astype(float) * trace.step_seconds


def fit_lomax_shape(x: np.ndarray) -> float:
    """Maximum-likelihood shape ``k`` of a Lomax fitted to lifetimes ``x`` (profile over σ).

    For a given scale σ the best shape is ``n / Σ log(1 + x/σ)``; σ is searched on a log grid.
    """
    x = np.asarray(x, dtype=float)
    x = x[x > 0]
    n = x.size
    if n < MIN_LIVES:
        return math.inf
    best_ll, best_k = -math.inf, math.inf
    for sigma in np.geomspace(np.median(x) * 1e-2, x.mean() * 1e3, 80):
        s = float(np.log1p(x / sigma).sum())
        k = n / s
        ll = n * math.log(k) - n * math.log(sigma) - (k + 1.0) * s
        if ll > best_ll:
            best_ll, best_k = ll, k
    return best_k


def rate_prior(traces: Sequence[Trace]) -> tuple[float, float]:
    """(prior MTBF, prior strength in seconds) of a Gamma prior as wide as the zones' spread.

    The mean is the pooled rate (preemptions / up-time). The shape ``α₀`` solves
    ``ψ₁(α₀) = Var[log r_i] - mean(1 / n_i)``: the spread of the per-trace log rates minus
    what Poisson noise alone would give. The strength is ``β₀ = α₀ · MTBF`` seconds.
    """
    counts = np.array([t.preemption_count() for t in traces], dtype=float)
    exposure = np.array([t.up_seconds() for t in traces], dtype=float)
    keep = exposure > 0
    counts, exposure = counts[keep], exposure[keep]
    if counts.size == 0:
        names = ", ".join(t.name for t in traces[:3]) + (", ..." if len(traces) > 3 else "")
        raise ValueError(
            f"no up-time in the history ({names or 'no traces'}): every tick is down, so no "
            "preemption rate can be fitted; give traces in which the VMs were up"
        )
    mtbf = float(exposure.sum() / max(counts.sum(), 0.5))
    if counts.size < 3:
        return mtbf, 6 * 3600.0  # too few zones to measure a spread: the old fixed weight
    n = counts + 0.5  # a zone with no preemption still has a finite log rate
    logs = np.log(n / exposure)
    spread = float(np.var(logs, ddof=1) - np.mean(1.0 / n))
    alpha0 = _inverse_trigamma(max(spread, 1e-3))
    return mtbf, alpha0 * mtbf


def rate_mixture(traces: Sequence[Trace]) -> list[tuple[float, float]] | None:
    """Gamma components ``(α, β)`` of a prior over a new zone's rate: one per trace, centred
    on its rate, as wide as a kernel density estimate of the log rates needs (Silverman's
    bandwidth ``b = 1.06·sd·N^(-1/5)``, and ``ψ₁(α) = b²``). A single Gamma (:func:`rate_prior`)
    is one bump in log rate; zones are not (calm ones and harsh ones, few between), and with
    a mixture a few lives of the job pick the bump they fit (``None``: fewer than 3 traces).
    """
    counts = np.array([t.preemption_count() for t in traces], dtype=float)
    exposure = np.array([t.up_seconds() for t in traces], dtype=float)
    keep = exposure > 0
    if keep.sum() < 3:
        return None
    n = counts[keep] + 0.5
    logs = np.log(n / exposure[keep])
    width = 1.06 * float(np.std(logs, ddof=1)) * logs.size**-0.2
    alpha = _inverse_trigamma(max(width * width, 1e-3))
    return [(alpha, alpha / math.exp(x)) for x in logs]


def _inverse_trigamma(y: float) -> float:
    """The α > 0 with ψ₁(α) = y (ψ₁ falls monotonically from +∞ to 0)."""
    from scipy.optimize import brentq  # lazy: see GammaPoissonRate._mixture
    from scipy.special import polygamma

    f = lambda a: float(polygamma(1, a)) - y  # noqa: E731
    return float(brentq(f, 1e-6, 1e7))


# Lomax shapes a posterior is kept over (inf: Poisson lives, no age effect).
SHAPE_GRID = (1.2, 1.5, 2.0, 3.0, 5.0, 10.0, math.inf)


def shape_prior(traces: Sequence[Trace], pseudo: float = 0.5) -> list[float] | None:
    """Prior weights over :data:`SHAPE_GRID`: one vote per trace for the grid shape nearest
    (in log) to its fitted one, plus ``pseudo`` for every shape so none is ruled out.
    ``None`` when no trace has enough lives to say anything."""
    votes = [pseudo] * len(SHAPE_GRID)
    seen = False
    finite = np.log(np.array(SHAPE_GRID[:-1]))
    for t in traces:
        k = fit_lomax_shape(lives(t))
        if not math.isfinite(k) and lives(t).size < MIN_LIVES:
            continue
        seen = True
        if k >= POISSON_SHAPE:
            votes[-1] += 1.0
        else:
            votes[int(np.argmin(np.abs(finite - math.log(max(k, MIN_SHAPE)))))] += 1.0
    if not seen:
        return None
    total = sum(votes)
    return [v / total for v in votes]


def _survival(age: float, mtbf: float, k: float) -> float:
    if math.isinf(k):
        return math.exp(-age / mtbf)
    return (1.0 + age / ((k - 1.0) * mtbf)) ** -k


def _hazard(age: float, mtbf: float, k: float) -> float:
    if math.isinf(k):
        return 1.0 / mtbf
    return k / ((k - 1.0) * mtbf + age)


class LifeShapePosterior:
    """Posterior over the Lomax shape ``k`` of this zone's lives, from the job's own lives.

    Lives are seen interval-censored: a process is known to have died between two ages (it
    was alive at its last checkpoint and dead before the next one could be durable). Each
    contributes ``log(S_k(lo) - S_k(hi))`` to shape ``k``'s log-likelihood, with the scale
    that gives the current mean life (``σ = (k - 1)·MTBF``). The likelihood is recomputed
    from the kept lives whenever the MTBF estimate moves (by 5 %): early lives judged
    against the prior's MTBF would otherwise leave a lasting bias. Planning uses the
    posterior predictive hazard of a VM that has survived to ``age``.
    """

    MAX_LIVES = 256  # the newest lives kept (the state stays small; old ones are forgotten)

    def __init__(self, prior: Sequence[float]) -> None:
        if len(prior) != len(SHAPE_GRID) or min(prior) <= 0:
            raise ValueError(f"prior={list(prior)} must be {len(SHAPE_GRID)} weights > 0")
        self.log_prior = [math.log(p) for p in prior]
        self.lives: list[tuple[float, float]] = []
        self.version = 0  # changes whenever the lives do: a key for what is built from them
        # loglik per MTBF bucket, for the lives seen so far (cleared when one is added).
        self._cache: dict[int, list[float]] = {}

    def observe(self, lo: float, hi: float) -> None:
        """One life that ended between ages ``lo`` and ``hi`` seconds."""
        if hi > lo:
            self.lives.append((max(lo, 0.0), float(hi)))
            if len(self.lives) > self.MAX_LIVES:
                del self.lives[0]
            self._cache = {}
            self.version += 1

    def loglik(self, mtbf: float) -> list[float]:
        if not (math.isfinite(mtbf) and mtbf > 0) or not self.lives:
            return [0.0] * len(SHAPE_GRID)
        bucket = round(20.0 * math.log(mtbf))
        cached = self._cache.get(bucket)
        if cached is not None:
            return cached
        m = math.exp(bucket / 20.0)
        lo = np.array([x for x, _ in self.lives])
        hi = np.array([y for _, y in self.lives])
        out = []
        for k in SHAPE_GRID:
            p = _survival_array(lo, m, k) - _survival_array(hi, m, k)
            out.append(float(np.log(np.maximum(p, 1e-300)).sum()))
        self._cache[bucket] = out
        return out

    def weights(self, age: float = 0.0, mtbf: float = math.inf) -> list[float]:
        logs = [a + b for a, b in zip(self.log_prior, self.loglik(mtbf), strict=True)]
        if age > 0 and math.isfinite(mtbf):
            survive = [_survival(age, mtbf, k) for k in SHAPE_GRID]
            logs = [x + math.log(max(p, 1e-300)) for x, p in zip(logs, survive, strict=True)]
        top = max(logs)
        w = [math.exp(x - top) for x in logs]
        total = sum(w)
        return [x / total for x in w]

    def mtbf_at_age(self, age: float, mtbf: float) -> float:
        """1 / the posterior predictive hazard at ``age`` s, for mean life ``mtbf``."""
        if not (math.isfinite(mtbf) and mtbf > 0):
            return mtbf
        w = self.weights(age, mtbf)
        h = sum(wi * _hazard(max(age, 0.0), mtbf, k) for wi, k in zip(w, SHAPE_GRID, strict=True))
        return 1.0 / h

    def state_dict(self) -> dict[str, list[list[float]]]:
        return {"lives": [[a, b] for a, b in self.lives]}

    def load_state_dict(self, state: dict) -> None:
        self.lives = [(float(a), float(b)) for a, b in state.get("lives", [])]
        self._cache = {}
        self.version += 1


def _survival_array(age: np.ndarray, mtbf: float, k: float) -> np.ndarray:
    if math.isinf(k):
        return np.exp(-age / mtbf)
    return (1.0 + age / ((k - 1.0) * mtbf)) ** -k


def cycle_interval(
    age: float,
    mtbf: float,
    stall: float,
    durable: float,
    weights: Sequence[float] | None = None,
) -> float:
    """Seconds from one save's start to the next that maximise durable work per second.

    A cycle starting at VM age ``a`` trains ``τ`` seconds, then saves: training is blocked
    ``stall`` s and the save is durable ``durable`` s after it started. The work ``τ`` is kept
    if the VM lives to ``a + τ + durable``; the cycle costs the expected wall time the VM
    lives within ``τ + stall``. With ``S`` the survival function of a life (a mixture over
    :data:`SHAPE_GRID` with ``weights``; Poisson if ``None``), the interval maximises

        g(τ) = τ · S(a + τ + durable) / ∫₀^{τ+stall} S(a + u) du

    For Poisson lives (``S = e^{-t/M}``) this is exactly Daly's optimum
    ``(e^{(τ+C)/M} - 1) / τ → min``; the returned value is ``τ + stall``.
    """
    if not (math.isfinite(mtbf) and mtbf > 0):
        return math.inf
    ks = np.array(SHAPE_GRID if weights is not None else (math.inf,))
    w = np.array(weights if weights is not None else (1.0,), dtype=float)[:, None]
    finite = np.isfinite(ks)
    kf = np.where(finite, ks, 2.0)[:, None]  # placeholder where Poisson; masked below
    sig = (kf - 1.0) * mtbf

    def survival(t: np.ndarray) -> np.ndarray:
        lomax = (1.0 + t / sig) ** -kf
        return np.where(finite[:, None], lomax, np.exp(-t / mtbf))

    def integral(a: float, x: np.ndarray) -> np.ndarray:
        # ∫_a^{a+x} S = M·[(1 + a/σ)^(1-k) - (1 + (a+x)/σ)^(1-k)] for a Lomax, since σ/(k-1) = M
        lomax = mtbf * ((1.0 + a / sig) ** (1.0 - kf) - (1.0 + (a + x) / sig) ** (1.0 - kf))
        poisson = mtbf * (math.exp(-a / mtbf) - np.exp(-(a + x) / mtbf))
        return np.where(finite[:, None], lomax, poisson)

    def gain(tau: np.ndarray) -> np.ndarray:
        kept = (w * survival(age + tau + durable)).sum(axis=0)
        spent = (w * integral(age, tau + stall)).sum(axis=0)
        return tau * kept / np.maximum(spent, 1e-300)

    lo = math.log(1e-3 * min(mtbf, 1.0 + stall))
    hi = math.log(100.0 * (mtbf + 5.0 * age) + 10.0 * durable)
    grid = np.exp(lo + (hi - lo) * _COARSE)
    i = int(np.argmax(gain(grid)))
    a, b = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, grid.size - 1)])
    fine = np.exp(a + (b - a) * _FINE)
    best = fine[int(np.argmax(gain(fine)))]
    return float(best + stall)


# Search grids of cycle_interval, in log space: coarse over 5 decades, then between the
# best point's neighbours (a step of ~0.5 %, far below the policy's 20 % hysteresis).
_COARSE = np.linspace(0.0, 1.0, 120)
_FINE = np.linspace(0.0, 1.0, 25)
