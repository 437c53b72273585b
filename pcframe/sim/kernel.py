"""Runs of saves every ``every`` steps, in Numba: the simulator's fast path.

Two callers. A policy whose :meth:`save_hint` says ``every=k`` promises that it saves exactly
every k steps and that nothing changes its state in between (``FixedSteps``): all its saves
up to the next event run here. And the steady-state fast-forward of
:class:`~pcframe.sim.process.Process` skips the ``decide`` calls of any policy whose last
saves were evenly spaced, then checks the policy agrees (see there).

Checkpointing every 10 iterations of a 1 s step over 45 days is 390,000 saves: too many for
Python, milliseconds here. The arithmetic is exactly that of ``Process._save`` (backpressure,
stall, time to durable), and a test runs both on the same schedule and compares.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def periodic_saves(
    seg_t0: float,
    seg_step0: int,
    step: int,
    first: int,
    every: int,
    it: float,
    stall: float,
    duration: float,
    serial: bool,
    n_max: int,
    fl_durable: np.ndarray,
    fl_step: np.ndarray,
    n_fl: int,
    last_durable: float,
    t_limit: float,
    step_limit: int,
    max_saves: int,
    out: np.ndarray,
) -> tuple[float, int, int, int, float, int, int, float, float]:
    """Save at steps ``first, first + every, ...`` while the decision time is <= ``t_limit``,
    the step <= ``step_limit`` and fewer than ``max_saves`` saves were made.

    The end of step s is at ``seg_t0 + (s - seg_step0) * it``; a save starts a new segment
    after its stall. ``fl_durable``/``fl_step`` (oldest first, ``n_fl`` valid, room for
    ``n_max + 1``) are the saves not committed yet, updated in place. When ``out`` has
    ``max_saves`` rows, row i receives save i's (step, start, durable time, stall).

    Returns ``(seg_t0, seg_step0, step, saves, stall_total, n_fl, committed_step,
    committed_at, last_durable)``; ``committed_step`` is -1 when no save became durable.
    """
    record = out.shape[0] >= max_saves
    saves = 0
    stall_total = 0.0
    committed_step = -1
    committed_at = -1.0
    s = first
    while s <= step_limit and saves < max_saves:
        t = seg_t0 + (s - seg_step0) * it
        if t > t_limit:
            break
        step = s
        # Saves durable by now are committed (the newest one is the restore point).
        k = 0
        while k < n_fl and fl_durable[k] <= t:
            committed_step = fl_step[k]
            committed_at = fl_durable[k]
            k += 1
        if k:
            for j in range(n_fl - k):
                fl_durable[j] = fl_durable[j + k]
                fl_step[j] = fl_step[j + k]
            n_fl -= k
        start = t
        if n_fl >= n_max:
            # Backpressure: a slot frees when the oldest in-flight save is durable. It stays
            # listed (uncommitted) until the next decision: a kill during the wait must not
            # find it committed.
            start = fl_durable[0]
        durable = last_durable + duration if serial and last_durable > start else start + duration
        fl_durable[n_fl] = durable
        fl_step[n_fl] = s
        n_fl += 1
        last_durable = durable
        seg_t0 = start + stall
        seg_step0 = s
        stall_total += seg_t0 - t
        if record:
            out[saves, 0] = s
            out[saves, 1] = start
            out[saves, 2] = durable
            out[saves, 3] = seg_t0 - t
        saves += 1
        s += every
    return (
        seg_t0,
        seg_step0,
        step,
        saves,
        stall_total,
        n_fl,
        committed_step,
        committed_at,
        last_durable,
    )
