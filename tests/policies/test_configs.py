"""Every Hydra config under conf/policy instantiates to the policy it names."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

import pcframe.policies as P
from pcframe.policies.registry import kind_of
from pcframe.policies.traces import shared_traces_dir

CONF = Path(__file__).resolve().parents[2] / "conf" / "policy"
GROUPS = ("interval", "placement", "resource")
FILES = sorted(p for g in GROUPS for p in (CONF / g).glob("*.yaml"))


def test_one_config_per_shipped_policy() -> None:
    for group in GROUPS:
        shipped = {n for n in P.available(group) if P.get(n).__module__.startswith("pcframe.")}
        have = {p.stem for p in (CONF / group).glob("*.yaml")}
        assert shipped <= have, f"conf/policy/{group} lacks {sorted(shipped - have)}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_config_instantiates(path: Path) -> None:
    cfg = OmegaConf.load(path)
    if "from_traces" in OmegaConf.to_yaml(cfg) and shared_traces_dir() is None:
        pytest.skip("config reads the shipped traces, which are absent in this checkout")
    obj = instantiate(cfg)
    assert kind_of(type(obj)) == path.parent.name
    assert obj.name == path.stem  # file name = registry name
    if isinstance(obj, P.NoticeDriven):
        assert isinstance(obj.inner, P.Daly) and isinstance(obj.source, P.SignalNoticeSource)
    if isinstance(obj, P.PreemptionAware):
        assert isinstance(obj.predictor, P.GammaPoissonRate)
        assert 0 < obj.predictor.predict().rate.value < 1  # a prior from real traces
