"""A ``load_state_dict`` that raises during a restore: the error names the object and its
first failure, every other object is put back, and the checkpoint on disk is untouched.

The object that raised may be half loaded, so its own state is put back too (its
``load_state_dict`` called again, with what it held before). When that fails as well (an
object that refuses every state), the message says which object may be partly loaded, still
names the first failure, and chains it. Before, it said "the objects may be partly loaded"
with no name, chained the rollback's error instead, and ``strict=False`` left the objects
loaded before it as loaded.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from pcframe import Checkpointer, CheckpointError
from pcframe.policies import FixedSteps
from tests.faults.test_restore_atomicity import SAVED_STEP, Counter, Job, committed_untouched

ONCE, ALWAYS = 1, 10**6  # how many loads raise


class Flaky(Counter):
    """A stateful object that takes the state, then raises: half loaded, ``fails`` times."""

    def __init__(self, value: int, fails: int = 0) -> None:
        super().__init__(value)
        self.fails, self.loads = fails, 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]
        self.loads += 1
        if self.fails:
            self.fails -= 1
            raise RuntimeError(f"flaky refuses (load {self.loads})")


class FlakyPolicy(FixedSteps):
    """An interval-policy plugin with learned state whose load raises like :class:`Flaky`."""

    def __init__(self, seen: int, fails: int = 0) -> None:
        super().__init__(every=10)
        self.seen, self.fails, self.loads = seen, fails, 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]
        self.loads += 1
        if self.fails:
            self.fails -= 1
            raise RuntimeError(f"plugin refuses (load {self.loads})")


def checkpointer(job: Job, directory, policy: FixedSteps) -> Checkpointer:
    return Checkpointer(
        directory,
        model=job.model,
        optimizer=job.opt,
        scheduler=job.sched,
        scaler=job.grad_scaler,
        data=job.data,
        stateful=job.counters,
        extra=job.extra,
        policy=policy,
    )


def files(directory) -> dict[str, bytes]:
    """The checkpoint's files (LATEST and the versions; not the writer's bookkeeping of
    process starts and exits) and a digest of the bytes of each."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).digest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


@pytest.fixture
def saved(tmp_path):
    """A complete job saved with two stateful objects and a policy with learned state."""
    directory = tmp_path / "ckpt"
    job = Job(steps=SAVED_STEP, counters={"a": Counter(4), "zz": Counter(4)})
    with checkpointer(job, directory, FlakyPolicy(seen=4)) as ckpt:
        ckpt.save(step=SAVED_STEP).wait()
    return directory


# which object raises -> (its live object, how errors name it, its first failure)
LABELS = {
    "stateful": ("stateful['zz']", "flaky refuses (load 1)"),
    "policy": ("policy (FlakyPolicy)", "plugin refuses (load 1)"),
}


def live_job(where: str, fails: int) -> tuple[Job, FlakyPolicy, Any]:
    """Objects that differ from the saved ones; the one at ``where`` raises ``fails`` times."""
    zz = Flaky(9, fails if where == "stateful" else 0)
    policy = FlakyPolicy(seen=9, fails=fails if where == "policy" else 0)
    job = Job(seed=7, counters={"a": Counter(9), "zz": zz})  # "a" loads before "zz"
    return job, policy, zz if where == "stateful" else policy


def state(job: Job, policy: FlakyPolicy) -> Any:
    return job.everything(), policy.state_dict()


@pytest.mark.parametrize("where", sorted(LABELS))
def test_a_load_that_raises_once_is_named_and_everything_is_put_back(saved, where):
    job, policy, failing = live_job(where, ONCE)
    before, on_disk = state(job, policy), files(saved)
    label, first = LABELS[where]
    with checkpointer(job, saved, policy) as ckpt:
        with pytest.raises(CheckpointError) as caught:
            ckpt.restore()
        message = str(caught.value)
        assert f"loading {label} failed (RuntimeError: {first}); every object was rolled " in (
            message
        )
        assert "partly loaded" not in message
        assert str(caught.value.__cause__) == first
        assert failing.loads == 2  # the half-loaded object was put back too
        assert state(job, policy) == before
    assert files(saved) == on_disk
    committed_untouched(saved)
    with checkpointer(Job(seed=7, counters={"a": Counter(), "zz": Counter()}), saved, policy) as c:
        assert c.restore() == SAVED_STEP  # the version itself was never at fault


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "strict=False"])
@pytest.mark.parametrize("where", sorted(LABELS))
def test_a_load_that_always_raises_names_what_may_be_partly_loaded(saved, where, strict):
    job, policy, failing = live_job(where, ALWAYS)
    before, on_disk = state(job, policy), files(saved)
    label, first = LABELS[where]
    with checkpointer(job, saved, policy) as ckpt:
        with pytest.raises(CheckpointError) as caught:
            ckpt.restore(strict=strict)
        message = str(caught.value)
        assert "\n" not in message
        assert f"loading {label} failed (RuntimeError: {first})" in message
        assert f"{label} may be partly loaded" in message
        assert f"putting back {label} raised RuntimeError: {first[:-2]}2)" in message
        assert message.endswith(f"restore again or rebuild {label}")
        assert str(caught.value.__cause__) == first  # the first failure, not the rollback's
        assert failing.loads == 2
        # Every other object is back as it was (the failing one sets its value, then raises).
        assert state(job, policy) == before
    assert files(saved) == on_disk
    committed_untouched(saved)
