"""The machine's limits are measured for real, leave nothing behind, and frame the tuner's best."""

from __future__ import annotations

import optuna
import pytest

from pcframe.apps.limits import BLOCK, measure_limits
from pcframe.apps.tuning.report import limit_lines


def test_limits_are_measured_and_the_probe_file_is_removed(tmp_path):
    limits = measure_limits(tmp_path, 1, repeats=1)
    assert limits.nbytes == BLOCK  # rounded up to whole blocks
    for rate in (limits.memcpy, limits.memcpy_one_thread, limits.disk_write_1):
        assert 0 < rate.low <= rate.median <= rate.high
    assert limits.disk_write.median == max(limits.disk_write_1.median, limits.disk_write_4.median)
    assert limits.disk_read.median > 0
    # No comparison of the rates: one repeat each on a busy machine can put a copy starved
    # of CPU below a write into a fast disk's cache (seen: 0.94 vs 1.04 GB/s).
    assert list(tmp_path.iterdir()) == []
    assert limits.memcpy_seconds(10**9) == pytest.approx(10**9 / limits.memcpy.median)


def test_the_best_trial_is_stated_against_the_limits(tmp_path):
    limits = measure_limits(tmp_path, BLOCK, repeats=1)
    study = optuna.create_study()
    trial = optuna.trial.create_trial(
        value=1.0,
        user_attrs={"checkpoint_bytes": BLOCK, "stall_s": 0.01, "durable_s": 0.5},
    )
    study.add_trial(trial)
    lines = limit_lines(study.best_trial, limits)
    memcpy_ratio = 0.01 / limits.memcpy_seconds(BLOCK)
    assert f"= {memcpy_ratio:.2f}x one memcpy" in lines[1]
    assert f"= {0.5 / limits.disk_seconds(BLOCK):.2f}x what the disk" in lines[2]
    assert limit_lines(study.best_trial, None)[0].startswith("machine limits not measured")
