"""Where an object goes (a policy, a predictor, a notice source), a class or a registry name
given instead is refused at once, in one line of one form, wherever it is given."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import pcframe.policies as P
from pcframe import Checkpointer
from pcframe.sim import simulate, steady_trace


def _engine(tmp_path: Path, key: str) -> Callable[[Any], object]:
    def make(given: Any) -> object:
        with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), **{key: given}) as ckpt:
            return ckpt

    return make


# key= and how to give it: (what it must be, the fix the message gives, None allowed)
PLACES: dict[str, tuple[Callable[[Path], Callable[[Any], object]], str, str, bool]] = {
    "policy": (lambda p: _engine(p, "policy"), "an interval policy", "FixedSteps(100)", True),
    "placement": (lambda p: _engine(p, "placement"), "a placement policy", "SingleTier()", True),
    "predictor": (
        lambda _: lambda v: P.PreemptionAware(predictor=v),
        "a predictor",
        "GammaPoissonRate(3600.0)",
        True,
    ),
    "inner": (
        lambda _: lambda v: P.NoticeDriven(inner=v),
        "an interval policy",
        "Daly(mtbf=3600.0)",
        True,
    ),
    "source": (
        lambda _: lambda v: P.NoticeDriven(source=v),
        "a notice source",
        "SignalNoticeSource(['SIGTERM'])",
        True,
    ),
    "interval": (  # the simulator's; the one place None is not taken
        lambda _: lambda v: simulate(steady_trace(hours=1.0), v),
        "an interval policy",
        "Daly(mtbf=3600.0)",
        False,
    ),
}


@pytest.mark.parametrize("key", list(PLACES))
@pytest.mark.parametrize("given", ["class", "name", "other"])
def test_a_class_or_a_name_where_an_object_goes_is_refused_in_one_form(
    tmp_path: Path, key: str, given: str
) -> None:
    """Five places checked this each in its own words (one named the class, one only the
    type, one said "must be", one had no fix for a class): now one helper
    (``pcframe.runtime.checks.require_object``), the key and its fix kept."""
    make, kind, example, optional = PLACES[key]
    classes = {"placement": P.SingleTier, "source": P.SignalNoticeSource, "predictor": P.EwmaRate}
    cls = classes.get(key, P.Daly)  # the other three take an interval policy
    value = {"class": cls, "name": "daly", "other": 3}[given]
    with pytest.raises(TypeError) as refused:
        make(tmp_path)(value)
    fix = {
        "class": f"{key}={cls.__name__}(...)",
        "name": f"{key}=pcframe.policies.create('daly', ...) or {key}={example}",
        "other": f"{key}={example}",
    }[given]
    lacks = {"policy": "decide", "placement": "place", "predictor": "predict"}.get(key)
    what = {
        "class": f"the class {cls.__name__}",
        "name": "the name 'daly'",
        "other": f"3 (it has no {lacks}())" if lacks else "3",
    }[given]
    none = ", or None" if optional else ""
    assert str(refused.value) == f"{key}= is {what}, not {kind} object: give one, e.g. {fix}{none}"
