"""``pcframe-run`` (the README's main command) works end to end as a Hydra app."""

from __future__ import annotations

import subprocess

import pytest

from pcframe.store.directory import CheckpointDir


@pytest.mark.slow
def test_pcframe_run_trains_checkpoints_and_summarises(tmp_path, python, child_env):
    ckpt_dir = tmp_path / "ckpts"
    result = subprocess.run(
        [
            python,
            "-m",
            "pcframe.apps.run",
            "steps=60",
            "threads=1",
            f"directory={ckpt_dir}",
            "workload.args.hidden=64",
            "policy.interval.every=20",
            # One in flight: with two, a version finishing after the next is discarded (by
            # design), and the three versions asserted below would not all stand.
            "engine.max_in_flight=1",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for label in (
        "steps/s without checkpointing",
        "steps/s with checkpointing",
        "checkpoints committed",
        "bytes written",
        "stall per checkpoint",
        "run-to-run spread of the baseline",
    ):
        assert label in result.stdout
    assert CheckpointDir(ckpt_dir).committed_versions() == [1, 2, 3]


def test_pcframe_run_rejects_a_typo_naming_the_key(tmp_path, python, child_env):
    result = subprocess.run(
        [python, "-m", "pcframe.apps.run", "engine.max_inflight=3", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=120,
    )
    assert result.returncode != 0
    assert "max_inflight" in result.stderr


def test_an_added_unknown_engine_key_is_a_config_error_with_a_suggestion(tmp_path):
    from pcframe.apps.compose import compose_config, engine_config
    from pcframe.errors import ConfigError

    cfg = compose_config("run", ["+engine.max_inflight=3"])
    with pytest.raises(ConfigError, match=r"engine\.max_inflight .* engine\.max_in_flight\?"):
        engine_config(cfg)
