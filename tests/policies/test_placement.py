"""Placement: routine tiers, every k-th upload, retention, and the notice fast path."""

from __future__ import annotations

import math
import re

import pytest

import pcframe.policies as P
from pcframe.errors import PolicyError
from pcframe.policies import Notice, PlacementContext
from pcframe.policies.placement import ask_placement


def place(policy: P.PlacementPolicy, version: int, **kw: object) -> P.PlacementDecision:
    return policy.place(PlacementContext(version=version, step=10 * version, now=0.0, **kw))  # type: ignore[arg-type]


def test_single_tier_and_retention() -> None:
    p = P.SingleTier("local", keep=2)
    d = place(p, 5, committed={"local": (2, 3, 4)})
    assert d.tiers == ("local",)
    assert d.keep == {"local": (4, 5)}  # applied after v5 commits: 2 and 3 may go


def test_memory_in_front_of_disk() -> None:
    p = P.MemoryThenDisk(disk_every=2, memory_keep=1, disk_keep=2)
    times = {"memory": 0.2, "local": 3.0}
    assert place(p, 1, tier_write_times=times).tiers == ("memory",)
    d = place(p, 2, tier_write_times=times, committed={"memory": (1,), "local": ()})
    assert d.tiers == ("memory", "local")  # fastest first
    assert d.keep == {"memory": (2,), "local": (2,)}


def test_local_plus_remote_uploads_every_kth() -> None:
    p = P.LocalPlusRemote(remote_every=3, local_keep=2, remote_keep=2)
    uploaded = [v for v in range(1, 13) if "remote" in place(p, v).tiers]
    assert uploaded == [3, 6, 9, 12]
    d = place(p, 7, committed={"local": (5, 6), "remote": (3, 6)})
    assert d.tiers == ("local",)
    assert d.keep == {"local": (6, 7), "remote": (3, 6)}  # remote untouched by a local write


def test_notice_picks_the_fastest_surviving_tier_that_fits() -> None:
    p = P.TieredPlacement(
        [
            P.TierRule("memory", survives_preemption=False),
            P.TierRule("pd", survives_preemption=True),
            P.TierRule("s3", every=5, survives_preemption=True),
        ],
        margin=5.0,
    )
    times = {"memory": 0.5, "pd": 20.0, "s3": 8.0}
    # 30 s left, 25 after the margin: s3 (8 s) is the fastest durable tier; memory dies with
    # the VM, so it is never the answer to a notice, however fast.
    d = place(p, 3, tier_write_times=times, notice=Notice(0.0, 30.0))
    assert d.tiers == ("s3",) and "s3" in d.reason
    times["s3"] = 40.0
    assert place(p, 3, tier_write_times=times, notice=Notice(0.0, 30.0)).tiers == ("pd",)
    # nothing fits: best effort on the fastest durable tier
    d = place(p, 3, tier_write_times=times, notice=Notice(0.0, 10.0))
    assert d.tiers == ("pd",) and "best effort" in d.reason


def test_notice_with_unknown_write_times_keeps_config_order() -> None:
    p = P.LocalPlusRemote(local_survives_preemption=True)
    d = place(p, 1, notice=Notice(0.0, 100.0))
    assert d.tiers == ("local",) and "best effort" in d.reason


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        P.TieredPlacement([P.TierRule("a"), P.TierRule("a")])
    with pytest.raises(ValueError, match="every"):
        P.TierRule("a", every=0)
    with pytest.raises(ValueError, match="at least one"):
        P.TieredPlacement([])


class _Answers(P.PlacementPolicy):
    """A placement that answers what it is given (or raises it)."""

    name = "answers"

    def __init__(self, answer: object) -> None:
        self.answer = answer

    @property
    def tiers(self) -> tuple[str, ...]:
        return ("local", "remote")

    def place(self, ctx: PlacementContext) -> P.PlacementDecision:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("answer", "wrong"),
    [
        (RuntimeError("boom\nsecond line"), "raised RuntimeError: boom second line for version 7"),
        (None, "returned None for version 7, not a PlacementDecision"),
        (("local",), "returned ('local',) for version 7, not a PlacementDecision"),
        (P.PlacementDecision("local"), "returned tiers='local' for version 7, not a tuple"),  # type: ignore[arg-type]
        (P.PlacementDecision((1,)), "returned tiers=(1,) for version 7, not a tuple"),  # type: ignore[arg-type]
        (P.PlacementDecision(()), "returned no tier for version 7"),
        (P.PlacementDecision(("disk",)), "placed version 7 in ['disk'], not among its tiers"),
        (P.PlacementDecision(("local",), keep=None), "returned keep=None for version 7"),  # type: ignore[arg-type]
        (
            P.PlacementDecision(("local",), keep={"disk": (7,)}),
            "returned keep for tier(s) 'disk' for version 7, not among its tiers",
        ),
        (
            P.PlacementDecision(("local",), keep={"local": "7"}),  # type: ignore[dict-item]
            "returned keep['local']='7' for version 7, not a tuple of version numbers",
        ),
        (
            P.PlacementDecision(("local",), keep={"local": (7.0,)}),  # type: ignore[dict-item]
            "returned keep['local']=(7.0,) for version 7, not a tuple of version numbers",
        ),
        (
            P.PlacementDecision(("local",), keep={"local": (True,)}),  # type: ignore[dict-item]
            "returned keep['local']=(True,) for version 7, not a tuple of version numbers",
        ),
        (  # an int reason went into the logs as it was, a dict broke "; ".join on a notice
            P.PlacementDecision(("local",), reason=5),  # type: ignore[arg-type]
            "returned a PlacementDecision for version 7 with reason=5 (int): the reason must",
        ),
        (
            P.PlacementDecision(("local",), reason={"a": "b\nc"}),  # type: ignore[arg-type]
            "with reason={'a': 'b\\nc'} (dict): the reason must be a str",
        ),
    ],
)
def test_a_bad_answer_is_one_policy_error_naming_the_policy(answer: object, wrong: str) -> None:
    """The one check the engine and the simulator make of every answer."""
    policy = _Answers(answer)
    ctx = PlacementContext(version=7, step=70, now=0.0)
    with pytest.raises(PolicyError) as raised:
        ask_placement(policy, ctx, policy.tiers, then="what it means here")
    text = str(raised.value)
    assert "\n" not in text
    assert text.startswith(
        "placement policy 'answers' (tests.policies.test_placement._Answers).place "
    ), text
    assert wrong in text, text
    assert "; what it means here. Fix: " in text, text
    if isinstance(answer, BaseException):
        assert raised.value.__cause__ is answer


def test_good_answers_pass_the_check_unchanged() -> None:
    import numpy as np

    for answer in (
        P.PlacementDecision(("local", "remote"), keep={"local": (6, 7), "remote": [7]}),
        P.PlacementDecision(["remote"], keep={"remote": {np.int64(7)}}),  # type: ignore[arg-type]
        P.PlacementDecision(("local",)),
    ):
        policy = _Answers(answer)
        ctx = PlacementContext(version=7, step=70, now=0.0)
        assert ask_placement(policy, ctx, policy.tiers) is answer


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: P.SingleTier(keep=math.nan), "keep=nan"),
        (lambda: P.SingleTier(keep=1.5), "keep=1.5"),
        (lambda: P.SingleTier(keep="2"), "keep='2'"),
        (lambda: P.MemoryThenDisk(disk_every=math.nan), "every=nan"),
        (lambda: P.LocalPlusRemote(remote_every=2.5), "every=2.5"),
        (lambda: P.SingleTier(margin=math.nan), "margin=nan"),
    ],
)
def test_tier_counts_and_margin_are_checked_when_made(make, key) -> None:
    """keep=nan or 1.5 passed ``< 1``: the placement was built, and every place() then
    raised a TypeError ('slice indices must be integers') that the engine reported as the
    policy failing to place each version, with a fix about place(), not about the key."""
    with pytest.raises(ValueError, match=re.escape(key)):
        make()
