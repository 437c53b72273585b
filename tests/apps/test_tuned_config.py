"""Tuning presets contain the default engine; a tuned config says what it was tuned for."""

from __future__ import annotations

import json

import optuna
import pytest
from omegaconf import OmegaConf

from pcframe.apps.compose import engine_config
from pcframe.apps.machine import machine_identity
from pcframe.apps.tuning import base_params, parse_space, write_tuned_config
from pcframe.apps.tuning.report import META_PREFIX, read_tuned_meta, tuned_config_warnings
from pcframe.config import EngineConfig
from tests.apps.conftest import CONF, compose

PRESETS = sorted(p.stem for p in (CONF / "tune").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_searches_a_space_that_contains_the_default_engine(preset, tmp_path):
    cfg = compose("tune", f"tune={preset}", directory=tmp_path)
    knobs = parse_space(cfg.tune.space)
    base = base_params(engine_config(cfg), knobs)
    assert set(base) == {k.name for k in knobs}, f"tune={preset} leaves out the default engine"
    assert engine_config(cfg) == EngineConfig()  # the base engine is the shipped default


def test_the_presets_are_documented(tmp_path):
    docs = (CONF.parent / "docs" / "tuning.md").read_text()
    for preset in PRESETS:
        assert f"`tune={preset}`" in docs


def _tuned(tmp_path, workload: dict) -> tuple:
    study = optuna.create_study()
    dist = {"max_in_flight": optuna.distributions.IntDistribution(1, 4)}
    study.add_trial(
        optuna.trial.create_trial(params={"max_in_flight": 3}, distributions=dist, value=0.1)
    )
    path = tmp_path / "user-conf" / "engine" / "tuned.yaml"
    write_tuned_config(
        path, EngineConfig(max_in_flight=3), study, study.trials[0], ["overhead"],
        workload=workload, threads=1,
    )  # fmt: skip
    hydra_cfg = OmegaConf.create(
        {
            "runtime": {
                "choices": {"engine": "tuned"},
                "config_sources": [
                    {"path": "pcframe.conf", "schema": "pkg", "provider": "main"},
                    {"path": str(path.parent.parent), "schema": "file", "provider": "x"},
                ],
            }
        }
    )
    return path, hydra_cfg


def test_a_tuned_config_records_workload_and_machine(tmp_path):
    gpt = {"name": "gpt", "args": {"width": 256}}
    path, _ = _tuned(tmp_path, gpt)
    meta = read_tuned_meta(path)
    assert meta["workload"] == gpt and meta["threads"] == 1
    assert meta["machine"] == machine_identity()
    text = path.read_text()
    assert "# Tuned for workload gpt(width=256)" in text
    assert OmegaConf.load(path).max_in_flight == 3  # still a plain engine option


def test_pcframe_run_warns_when_the_tuned_config_is_for_another_setup(tmp_path):
    cfg = compose("run", "workload=tiny", directory=tmp_path)
    here = {"name": "mlp", "args": OmegaConf.to_container(cfg.workload.args)}
    _, hydra_cfg = _tuned(tmp_path, here)
    assert tuned_config_warnings(cfg, hydra_cfg) == []  # same workload, same machine
    other = tmp_path / "other"
    _, hydra_cfg = _tuned(other, {"name": "gpt", "args": {}})
    (warning,) = tuned_config_warnings(cfg, hydra_cfg)
    assert "was tuned for another setup: workload gpt there, mlp here" in warning
    # another machine: the recorded CPUs differ
    path, hydra_cfg = _tuned(tmp_path / "m", here)
    meta = read_tuned_meta(path)
    meta["machine"]["cpus"] = 1000
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith(META_PREFIX)]
    path.write_text("\n".join([META_PREFIX + json.dumps(meta), *lines]) + "\n")
    (warning,) = tuned_config_warnings(cfg, hydra_cfg)
    assert "cpus 1000 there" in warning
