"""Kill schedules: Poisson, a recorded trace time-compressed, explicit times."""

from __future__ import annotations

import statistics

import pytest

from pcframe.apps.preemption import poisson_times, resolve_trace, trace_times
from pcframe.errors import ConfigError
from pcframe.policies.traces import load_trace


def test_poisson_is_seeded_increasing_with_the_right_mean():
    times = poisson_times(mtbf=5.0, count=4000, seed=3)
    assert times == poisson_times(mtbf=5.0, count=4000, seed=3)
    assert times != poisson_times(mtbf=5.0, count=4000, seed=4)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(5.0, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(5.0, rel=0.1)  # exponential: sd = mean


def test_trace_kills_where_the_real_trace_loses_capacity(traces_dir):
    path = "pccheck/gpus_trace.csv"
    trace = load_trace(resolve_trace(path))
    drops = trace.preemption_ticks() * trace.step_seconds
    assert len(drops) > 5
    times = trace_times(path, compression=100.0)
    assert times == pytest.approx([t / 100.0 for t in drops])
    offset = float(drops[3])
    shifted = trace_times(path, compression=10.0, offset=offset)
    assert shifted[0] == 0.0 and len(shifted) == len(drops) - 3
    assert shifted == pytest.approx([(t - offset) / 10.0 for t in drops[3:]])


def test_explicit_times_are_sorted_and_compressed():
    assert trace_times(times=[30.0, 10.0], compression=10.0) == [1.0, 3.0]
    with pytest.raises(ConfigError, match="negative"):
        trace_times(times=[-1.0])
    # NaN fails every comparison: it was dropped without a word, and fewer kills came
    for times in ([float("nan")], [1.0, float("nan")], [float("inf")]):
        with pytest.raises(ConfigError, match=r"failure\.times=.* finite"):
            trace_times(times=times)
    with pytest.raises(ConfigError, match=r"failure\.offset=nan"):
        trace_times(times=[1.0], offset=float("nan"))
