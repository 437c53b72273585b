"""The plugin passes pcframe's conformance kit, is found by name, and does its own job."""

from pcframe_example_policy import StepsOrSeconds

from pcframe.policies import PolicyContext, get
from pcframe.testing import IntervalPolicyConformance


class TestConformance(IntervalPolicyConformance):
    factory = staticmethod(lambda: StepsOrSeconds(steps=40, seconds=60.0))


def test_found_through_the_entry_point() -> None:
    assert get("steps_or_seconds") is StepsOrSeconds


def test_saves_on_whichever_comes_first() -> None:
    p = StepsOrSeconds(steps=10, seconds=100.0)
    p.decide(PolicyContext(step=0, now=0.0))
    assert not p.decide(PolicyContext(step=9, now=50.0)).save
    assert p.decide(PolicyContext(step=10, now=51.0)).save  # steps first
    assert p.decide(PolicyContext(step=12, now=151.0)).save  # then seconds
