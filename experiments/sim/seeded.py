"""The seed-averaged hindsight yardstick of experiment 5 (issue 43, item 5).

The best fixed interval in hindsight on one simulation of a trace partly wins by phase
luck: with long intervals, whether a checkpoint lands just before the preemption that ends
a long life decides a whole interval of work (``sim_hindsight_phase.md``). No interval
chosen before the preemptions can know that phase, and real restarts do not take the same
time twice. So every policy here is simulated over ``seeds`` restart-jitter draws
(``JobSpec.restart_jitter``, a fraction of the job's restart time; ``SimOptions.seed``), the
same draws for every policy (the ``i``-th start of seed ``s`` draws the same restart time
whatever the policy, because starts follow the trace, not the policy), and:

* the fixed-interval curve is the mean over seeds at every candidate interval;
* hindsight is the best interval of that mean curve (a geometric grid of seconds from 20 s
  to the trace's length, then a finer grid between the best point's neighbours);
* a policy's ratio is its mean goodput over the seeds divided by that curve's best; its
  standard error is the delta-method one of a ratio of paired means (same seeds), so it
  says how far the ratio could move with other draws of the same jitter.

Simulations run in a pool of processes (fork: the traces are shared, not pickled) and the
yardsticks (fixed intervals, the oracle, Daly) are cached in a JSON file between runs, keyed
by regime, trace, policy, interval, seed and jitter, so a change to the policy under test
re-runs only that policy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from loo import SECONDS_GRID, history_for, key_of, zone_of
from profiles import job_for

import pcframe.policies as P
from pcframe.policies.traces import Trace
from pcframe.sim import JobSpec, Oracle, SimOptions, simulate

Factory = Callable[[Trace, list[Trace]], P.IntervalPolicy]
# Seconds-grid ratio of SECONDS_GRID (36 points from 20 s to 12 h: ~24.5 % apart).
RATIO = SECONDS_GRID[1] / SECONDS_GRID[0]
YARDSTICKS = ("fixed", "oracle", "Daly@true", "Daly@prior")
REFINE = 12  # points of the finer grid between the best grid point's neighbours

# Set before the pool forks (the workers read them; nothing is pickled but the tasks).
_TRACES: list[Trace] = []
_FACTORIES: dict[str, Factory] = {}
_JITTER = 0.1


def jittered_job(trace: Trace, regime: str, fraction: float) -> JobSpec:
    """The experiment's job with each start's restart time drawn around its mean
    (standard deviation ``fraction`` of it)."""
    job = job_for(trace, regime)
    return dataclasses.replace(job, restart_jitter=fraction * job.restart_cost)


def candidate_seconds(trace: Trace) -> list[float]:
    """SECONDS_GRID, continued with the same ratio up to the trace's length (calm zones
    are best with intervals of days; the first 36 points are the ones chosen in advance)."""
    out = list(SECONDS_GRID)
    while out[-1] * RATIO < trace.duration:
        out.append(out[-1] * RATIO)
    return out


@dataclass(frozen=True)
class Task:
    """One simulation: ``policy`` is ``fixed`` (``every`` steps), ``oracle``, ``Daly@true``,
    ``Daly@prior`` or the name of a factory."""

    regime: str
    trace: int
    policy: str
    seed: int
    every: int = 0

    def cache_key(self, jitter: float) -> str:
        t = _TRACES[self.trace]
        return f"{self.regime}|{key_of(t)}|{self.policy}|{self.every}|{self.seed}|{jitter:g}"


def _policy(task: Task, trace: Trace) -> P.IntervalPolicy:
    if task.policy == "fixed":
        return P.FixedSteps(task.every)
    if task.policy == "oracle":
        return Oracle()
    if task.policy == "Daly@true":  # clairvoyant: the trace's own mean life, in advance
        return P.Daly(mtbf=trace.mtbf())
    history = history_for(trace, _TRACES)
    if task.policy == "Daly@prior":
        count = sum(t.preemption_count() for t in history)
        exposure = sum(t.up_seconds() for t in history)
        return P.Daly(mtbf=exposure / max(count, 0.5))
    return _FACTORIES[task.policy](trace, history)


def _run(task: Task) -> tuple[Task, float, float, int]:
    """(task, goodput, simulated CPU seconds, starts)."""
    trace = _TRACES[task.trace]
    job = jittered_job(trace, task.regime, _JITTER)
    result = simulate(trace, _policy(task, trace), job, options=SimOptions(seed=task.seed))
    return task, result.goodput, result.sim_seconds, result.starts


def _cached(task: Task) -> bool:
    """The yardsticks do not change with the policy under test: they are cached."""
    return task.policy in YARDSTICKS


class Runner:
    """Runs tasks in a pool, fixed-interval ones through a JSON cache."""

    def __init__(
        self,
        traces: Sequence[Trace],
        factories: dict[str, Factory],
        jitter: float,
        workers: int,
        cache: Path | None,
    ) -> None:
        global _TRACES, _FACTORIES, _JITTER
        _TRACES, _FACTORIES, _JITTER = list(traces), dict(factories), jitter
        self.jitter, self.workers, self.cache_path = jitter, workers, cache
        self.cache: dict[str, float] = {}
        if cache is not None and cache.exists():
            self.cache = json.loads(cache.read_text())
        self.results: dict[Task, float] = {}
        self.sim_seconds: dict[Task, float] = {}
        self.starts: dict[Task, int] = {}

    def run(self, tasks: Iterable[Task]) -> None:
        todo = []
        for task in dict.fromkeys(tasks):
            if task in self.results:
                continue
            hit = self.cache.get(task.cache_key(self.jitter)) if _cached(task) else None
            if hit is not None:
                self.results[task] = hit
            else:
                todo.append(task)
        # The slowest first (learning policies on long traces), so the pool ends together.
        todo.sort(key=lambda t: (t.policy == "fixed", -_TRACES[t.trace].duration))
        ctx = multiprocessing.get_context("fork")
        start = time.perf_counter()
        with ctx.Pool(self.workers) as pool:
            runs = pool.imap_unordered(_run, todo, chunksize=1)
            for n, (task, goodput, sim_s, starts) in enumerate(runs, 1):
                if n % 500 == 0 or n == len(todo):
                    print(
                        f"  {n} / {len(todo)} simulations, {time.perf_counter() - start:.0f} s",
                        flush=True,
                    )
                self.results[task] = goodput
                self.sim_seconds[task] = sim_s
                self.starts[task] = starts
                if _cached(task):
                    self.cache[task.cache_key(self.jitter)] = goodput
        if self.cache_path is not None and todo:
            tmp = self.cache_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.cache))
            os.replace(tmp, self.cache_path)

    def goodputs(self, regime: str, trace: int, policy: str, seeds: int, every: int = 0):
        return [self.results[Task(regime, trace, policy, s, every)] for s in range(seeds)]


@dataclass
class Curve:
    """Seed-averaged goodput of ``FixedSteps`` at each interval tried (steps -> per seed)."""

    per_seed: dict[int, list[float]]
    base: list[int]  # the candidate grid (steps), SECONDS_GRID first

    def mean(self, every: int) -> float:
        return statistics.fmean(self.per_seed[every])

    def best(self) -> int:
        """The interval with the best mean (the shorter one on a tie, as
        ``best_fixed_interval`` does)."""
        return max(self.per_seed, key=lambda e: (self.mean(e), -e))


def seed_averaged(
    runner: Runner,
    traces: Sequence[Trace],
    regimes: Sequence[str],
    policies: Sequence[str],
    seeds: int,
    chosen: Sequence[int] | None = None,
) -> list[dict]:
    """One row per (regime, trace of ``chosen``, default all): the seed-averaged curve's
    best and every policy's seed-averaged goodput, ratio and standard error. The curves of
    the traces not chosen are needed too (the interval chosen in advance comes from them);
    without them ``in_advance`` is NaN."""
    chosen = list(range(len(traces))) if chosen is None else list(chosen)
    curves: dict[tuple[str, int], Curve] = {}
    tasks = []
    for regime in regimes:
        for i in chosen:
            trace = traces[i]
            it = job_for(trace, regime).step_time(trace.capacity)
            # Not de-duplicated: base[k] is SECONDS_GRID[k]'s interval (used in advance).
            base = [max(1, round(s / it)) for s in candidate_seconds(trace)]
            curves[(regime, i)] = Curve({}, base)
            for s in range(seeds):
                tasks += [Task(regime, i, "fixed", s, e) for e in base]
                tasks += [Task(regime, i, p, s) for p in (*policies, *YARDSTICKS[1:])]
    runner.run(tasks)
    refine = []
    for (regime, i), curve in curves.items():
        for e in curve.base:
            curve.per_seed[e] = runner.goodputs(regime, i, "fixed", seeds, e)
        best = curve.base.index(curve.best())
        lo, hi = curve.base[max(best - 1, 0)], curve.base[min(best + 1, len(curve.base) - 1)]
        for e in np.unique(np.round(np.geomspace(lo, hi, REFINE)).astype(int)):
            refine += [Task(regime, i, "fixed", s, int(e)) for s in range(seeds)]
    runner.run(refine)
    for task in refine:
        curves[(task.regime, task.trace)].per_seed[task.every] = runner.goodputs(
            task.regime, task.trace, "fixed", seeds, task.every
        )
    rows = []
    for (regime, i), curve in curves.items():
        trace = traces[i]
        job = job_for(trace, regime)
        every = curve.best()
        hind = curve.per_seed[every]
        h = statistics.fmean(hind)
        # What the old yardstick (the best interval of each seed) would have been.
        per_seed_best = statistics.fmean(
            max(curve.per_seed[e][s] for e in curve.per_seed) for s in range(seeds)
        )
        row = {
            "regime": regime,
            "source": trace.source,
            "trace": trace.name if trace.capacity == 1 else f"{trace.name} ({trace.capacity})",
            "mtbf_h": trace.mtbf() / 3600.0,
            "hindsight": h,
            "hindsight_se": _se(hind),
            "hindsight_every": every,
            "hindsight_s": every * job.step_time(trace.capacity),
            "per_seed_best": per_seed_best / h,
            "in_advance": _in_advance(curves, regime, i, traces) / h,
        }
        for p in (*policies, *YARDSTICKS[1:]):
            xs = runner.goodputs(regime, i, p, seeds)
            row[p] = statistics.fmean(xs) / h
            row[f"{p}_se"] = ratio_se(xs, hind)
            row[f"{p}_sim_s"] = statistics.fmean(
                runner.sim_seconds.get(Task(regime, i, p, s), math.nan) for s in range(seeds)
            )
        rows.append(row)
    return rows


def _in_advance(
    curves: dict[tuple[str, int], Curve], regime: str, i: int, traces: Sequence[Trace]
) -> float:
    """Seed-averaged goodput on trace ``i`` of the SECONDS_GRID interval with the best
    mean, relative to each trace's seed-averaged best, over the other zones' traces."""
    zone = zone_of(traces[i])
    others = [j for j, t in enumerate(traces) if zone_of(t) != zone]
    if any((regime, j) not in curves for j in others):
        return math.nan
    scores = []
    for k in range(len(SECONDS_GRID)):
        rel = []
        for j in others:
            c = curves[(regime, j)]
            rel.append(c.mean(c.base[k]) / c.mean(c.best()))
        scores.append(statistics.fmean(rel))
    c = curves[(regime, i)]
    return c.mean(c.base[int(np.argmax(scores))])


def ratio_se(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Standard error of mean(xs) / mean(ys) for paired samples (delta method): the
    standard error of the mean of ``x - r·y``, divided by mean(ys)."""
    n = len(xs)
    if n < 2:
        return math.nan
    r = statistics.fmean(xs) / statistics.fmean(ys)
    d = [x - r * y for x, y in zip(xs, ys, strict=True)]
    return statistics.stdev(d) / math.sqrt(n) / statistics.fmean(ys)


def _se(xs: Sequence[float]) -> float:
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan
