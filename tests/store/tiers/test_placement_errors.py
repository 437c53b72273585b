"""A placement policy that raises or answers what the engine cannot follow: a one-line
``PolicyError`` naming it, raised at the engine's next call (never only a log line), with
every committed version of the primary and of the replica intact."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import pcframe.policies as P
from pcframe import Checkpointer
from pcframe.apps.cli import main as pcframe_cli
from pcframe.errors import PolicyError
from pcframe.policies.base import Notice
from pcframe.policies.placement import PlacementContext, PlacementDecision, PlacementPolicy
from pcframe.restore.reader import load_version
from pcframe.save.status import SaveStatus
from pcframe.store.directory import CheckpointDir
from pcframe.store.tiers import Tiers
from tests.store.tiers.helpers import model_and_optimizer, step

FIRST_BAD = 3  # versions 1 and 2 are placed well and reach the replica

# What the policy answers from FIRST_BAD on, and what the error must say was wrong.
ANSWERS = {
    "raises": (
        None,
        r"\.place raised RuntimeError: no placement today \(a second line\) for version 3",
    ),
    "none": (None, r"\.place returned None for version 3, not a PlacementDecision"),
    "unknown_tier": (
        PlacementDecision(("local", "nowhere")),
        r"\.place placed version 3 in \['nowhere'\], not among its tiers \['local', 'replica'\]",
    ),
    "tiers_str": (
        PlacementDecision("local"),  # type: ignore[arg-type]
        r"\.place returned tiers='local' for version 3, not a tuple of tier names",
    ),
    "no_tier": (PlacementDecision(()), r"\.place returned no tier for version 3"),
    "keep_str": (
        PlacementDecision(("local", "replica"), keep={"local": "x"}),  # type: ignore[dict-item]
        r"\.place returned keep\['local'\]='x' for version 3, not a tuple of version numbers",
    ),
    "keep_unknown_tier": (
        PlacementDecision(("local", "replica"), keep={"remote": (3,)}),
        r"\.place returned keep for tier\(s\) 'remote' for version 3, not among its tiers",
    ),
    "keep_not_mapping": (
        PlacementDecision(("local", "replica"), keep=[3]),  # type: ignore[arg-type]
        r"\.place returned keep=\[3\] for version 3, not a mapping of tier to versions",
    ),
}
NAMED = r"placement policy 'broken_place' \(tests\.store\.tiers\.test_placement_errors\.Broken\)"


class Broken(PlacementPolicy):
    """A user's placement plugin: every version to the replica, which keeps its newest
    version only; from ``bad_from`` on, in the calls ``bad_call`` picks, a bad answer."""

    name = "broken_place"

    def __init__(
        self,
        mode: str,
        bad_from: int = FIRST_BAD,
        bad_call: Any = None,
        hold: threading.Event | None = None,
    ) -> None:
        self.mode, self.bad_from = mode, bad_from
        self.bad_call = bad_call or (lambda ctx, asked: True)
        self.hold = hold  # version 1's placement waits for it (the commit thread with it)
        self.holding = threading.Event()  # set once version 1's placement waits
        self.asked: Counter[int] = Counter()

    @property
    def tiers(self) -> tuple[str, ...]:
        return ("local", "replica")

    def place(self, ctx: PlacementContext) -> PlacementDecision:
        self.asked[ctx.version] += 1
        if self.hold is not None and ctx.version == 1:
            self.holding.set()
            assert self.hold.wait(30)
        if ctx.version >= self.bad_from and self.bad_call(ctx, self.asked[ctx.version]):
            if self.mode == "raises":
                raise RuntimeError("no placement today\n(a second line)")
            return ANSWERS[self.mode][0]  # type: ignore[return-value]
        return PlacementDecision(
            ("local", "replica"), keep={"local": (ctx.version,), "replica": (ctx.version,)}
        )


def _open(tmp_path: Path, placement: PlacementPolicy, **kw: Any) -> Checkpointer:
    model, opt = model_and_optimizer(width=16)
    return Checkpointer(
        tmp_path / "local",
        model=model,
        optimizer=opt,
        tiers=Tiers({"replica": tmp_path / "replica"}, backoff=0.05, backoff_max=0.2),
        placement=placement,
        policy=P.FixedSteps(1),
        keep_last=2,
        chunk_bytes=8192,
        **kw,
    )


def _written(ckpt: Checkpointer, queued: int) -> None:
    """Wait until ``queued`` versions are written and wait behind version 1's commit (held
    in its placement). The commit thread takes versions in the order their writes finish,
    and one that finishes after a newer one was published is discarded by design: saved
    back to back, version 3 may finish first on a busy machine."""
    commits = ckpt._pipeline._commit_queue  # the order in which versions will commit
    deadline = time.monotonic() + 30
    while commits.qsize() < queued:
        assert time.monotonic() < deadline, f"{queued} version(s) not written in 30 s"
        time.sleep(0.005)


def _save(ckpt: Checkpointer, s: int) -> None:
    step(ckpt.model, ckpt.optimizer, s)
    assert ckpt.save(s).wait() == SaveStatus.COMMITTED


def _first_two(ckpt: Checkpointer) -> None:
    for s in (1, 2):
        _save(ckpt, s)
        assert ckpt.tiers.wait_idle(30)
    assert CheckpointDir(ckpt.tiers.replicas["replica"].path).committed_versions() == [2]


def _one_line(exc: BaseException, what: str) -> None:
    """One line naming the policy (registered name and class), the method, what was
    wrong and the fix."""
    text = str(exc)
    assert "\n" not in text, text
    assert re.search(NAMED, text), text
    assert re.search(what, text), text
    assert "Fix: " in text, text


def _intact(tmp_path: Path, primary: list[int], replica: list[int]) -> None:
    """The primary's committed versions, each verified (``pcframe verify``), and the
    replica's versions, each loaded and checked."""
    assert CheckpointDir(tmp_path / "local").committed_versions() == primary
    assert pcframe_cli(["verify", str(tmp_path / "local")]) == 0
    assert CheckpointDir(tmp_path / "replica").committed_versions() == replica
    for version in replica:
        load_version(tmp_path / "replica" / f"v{version:08d}")


# Every answer at maybe_save; three of them at each other engine call.
CASES = [(mode, "maybe_save") for mode in sorted(ANSWERS)] + [
    (mode, call) for call in ("save", "wait", "close") for mode in ("raises", "none", "keep_str")
]


@pytest.mark.parametrize(("mode", "call"), CASES)
def test_a_bad_placement_is_raised_at_the_next_call_and_loses_nothing(
    tmp_path: Path, mode: str, call: str, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = _open(tmp_path, Broken(mode))
    try:
        _first_two(ckpt)
        # Version 3 stands in the primary: its own handle says committed, not failed.
        _save(ckpt, FIRST_BAD)
        assert ckpt.committed_versions()[-1] == FIRST_BAD
        with pytest.raises(PolicyError) as raised:
            if call == "maybe_save":
                ckpt.maybe_save(4)
            elif call == "save":
                ckpt.save(4)
            elif call == "wait":
                ckpt.wait()
            else:
                ckpt.close()
        _one_line(raised.value, ANSWERS[mode][1])
        assert "version 3 is committed in the primary tier 'local'" in str(raised.value)
        assert "was not copied to tier(s) ['replica'], whose versions are intact" in str(
            raised.value
        )
        assert ckpt.records[FIRST_BAD].status == SaveStatus.COMMITTED
        if call != "close":
            ckpt.wait()  # raised once: not again
            assert ckpt.tiers.wait_idle(30)
            ckpt.close()
    finally:
        ckpt.close(clean=False)
    assert not [r for r in caplog.records if "commit listener failed" in r.getMessage()]
    # Raised before step 4's save started (as a failed version's SaveError is). keep_last=2
    # for the primary; the replica keeps version 2, its newest, as the placement said when 2
    # was written there.
    _intact(tmp_path, [2, 3], [2])


@pytest.mark.parametrize("then", ["wait", "close"])
def test_a_placement_failing_in_the_replicas_retention_deletes_nothing_there(
    tmp_path: Path, then: str
) -> None:
    """Asked again once the replica has version 3 (what the replica keeps), it raises: the
    replica deletes nothing, and the error reaches the next call, close() included (the
    replicas' drain at close asks it last)."""
    second_ask = Broken("raises", bad_call=lambda ctx, asked: asked == 2)
    ckpt = _open(tmp_path, second_ask)
    try:
        _first_two(ckpt)
        _save(ckpt, FIRST_BAD)
        with pytest.raises(PolicyError) as raised:
            if then == "wait":
                assert ckpt.tiers.wait_idle(30)
                ckpt.wait()
            else:
                ckpt.close()
        _one_line(raised.value, ANSWERS["raises"][1])
        text = str(raised.value)
        assert "tier 'replica' deleted none of its versions (its retention after version 3" in text
        if then == "wait":
            ckpt.wait()  # raised once
            ckpt.close()
    finally:
        ckpt.close(clean=False)
    _intact(tmp_path, [2, 3], [2, 3])  # version 2 kept in the replica: nothing deleted


def test_a_placement_failing_for_a_notice_raises_from_maybe_save(tmp_path: Path) -> None:
    """At a preemption notice the engine asks the placement on the training thread (where
    the version must go to outlive the VM): its failure is raised from that maybe_save."""
    at_notice = Broken("raises", bad_call=lambda ctx, asked: ctx.notice is not None)
    with _open(tmp_path, at_notice) as ckpt:
        _first_two(ckpt)
        step(ckpt.model, ckpt.optimizer, FIRST_BAD)
        now = time.monotonic()
        with pytest.raises(PolicyError) as raised:
            ckpt.maybe_save(FIRST_BAD, notice=Notice(now, now + 60.0))
        _one_line(raised.value, ANSWERS["raises"][1])
        text = str(raised.value)
        assert "emergency version 3 is committed in the primary tier 'local'" in text
        assert "and was not secured in another tier" in text
        assert ckpt.committed_versions()[-1] == FIRST_BAD
        assert ckpt.tiers.wait_idle(30)
    _intact(tmp_path, [2, 3], [3])  # the routine placement copied it all the same


def test_a_broken_policy_failing_at_every_commit_raises_one_error_at_a_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three versions fail before the next call: the first is raised, the later ones are
    logged when they fail (not a chain of errors at the next calls)."""
    caplog.set_level(logging.ERROR, logger="pcframe.store.tiers")
    hold = threading.Event()
    policy = Broken("none", 1, hold=hold)
    with _open(tmp_path, policy, max_in_flight=4) as ckpt:
        handles = []
        for s in (1, 2, 3):  # version 1's commit waits in its placement: none reported yet
            step(ckpt.model, ckpt.optimizer, s)
            handles.append(ckpt.save(s))
            if s == 1:
                assert policy.holding.wait(30)
            else:
                _written(ckpt, queued=s - 1)
        hold.set()
        assert [h.wait() for h in handles] == [SaveStatus.COMMITTED] * 3
        with pytest.raises(PolicyError) as raised:
            ckpt.maybe_save(4)
        _one_line(raised.value, r"\.place returned None for version 1, not a PlacementDecision")
        ckpt.wait()  # the later failures were logged, not queued
    logged = [r.getMessage() for r in caplog.records if "broken_place" in r.getMessage()]
    assert len(logged) == 2, logged
    for version, line in zip((2, 3), logged, strict=True):
        assert f"for version {version}, not a PlacementDecision" in line
        assert "(logged: the failure about version 1 is raised first)" in line
    _intact(tmp_path, [2, 3], [])


def test_an_error_ending_the_with_block_is_not_replaced_by_a_placement_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A placement failure still waiting when an exception leaves the with block is logged
    by the close on the way out: the exception raised is the loop's own."""
    caplog.set_level(logging.ERROR)
    with pytest.raises(ZeroDivisionError), _open(tmp_path, Broken("raises")) as ckpt:
        _first_two(ckpt)
        _save(ckpt, FIRST_BAD)
        _ = 1 / 0
    logged = [r.getMessage() for r in caplog.records]
    assert [m for m in logged if "today (a second line) for version 3" in m], logged
    _intact(tmp_path, [2, 3], [2])
