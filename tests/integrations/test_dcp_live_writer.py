"""``dcp.load`` beside a live ``dcp.save`` loop: a version the writer's retention deletes
while a load reads it is gone, and the reader lists again or reads it through the files it
holds; never 'damaged', never a raw ``FileNotFoundError``.

The points of a load where a prune can land are hit on purpose with a load planner (DCP's
own extension point) that saves two more versions there (``keep_last=1``: the version the
load chose is deleted); a real writer, on real gloo ranks, races a loop of loads for the
rest.
"""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan

from pcframe.errors import CheckpointError, CorruptCheckpoint
from pcframe.integrations.dcp import StorageReader, StorageWriter
from tests.distributed.launch import REPO, base_env, free_port
from tests.integrations.dcp_ranks import (
    SHARDED,
    assert_loaded,
    fresh_state,
    sharded_value,
    training_state,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


LOADING = 120.0  # s of loads at most, for the writer to commit and prune four versions


def _save(root: Path, step: int) -> None:
    dcp.save(training_state(step), storage_writer=StorageWriter(root, keep_last=1, step=step))


class PrunesAt(DefaultLoadPlanner):
    """Runs ``prune`` at one point of DCP's load: once the plan is made (after the reader
    chose the version, before it knows what the plan reads) or as the read begins."""

    def __init__(self, at: str, prune: Callable[[], None]) -> None:
        super().__init__()
        self.at, self.prune = at, prune

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        if self.at == "planned":
            self.prune()
        return plan

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        if self.at == "read":
            self.prune()
        return super().finish_plan(new_plan)


def _failure(exc: CheckpointException) -> BaseException:
    (wrapped,) = exc.failures.values()
    return wrapped[0] if isinstance(wrapped, tuple) else wrapped


@pytest.mark.parametrize("at", ["planned", "read"])
def test_a_version_pruned_under_a_load_is_gone_not_damaged(
    tmp_path: Path, at: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    _save(root, 1)
    _save(root, 2)

    def prune() -> None:
        _save(root, 3)
        _save(root, 4)
        assert not (root / "v00000002").exists()  # the load's version is deleted

    net, opt, state = fresh_state()
    with caplog.at_level(logging.INFO, logger="pcframe"):
        dcp.load(state, storage_reader=StorageReader(root), planner=PrunesAt(at, prune))
    # Pruned once the plan is made: listed again, the newest read. Pruned as the read
    # begins: the files held since the plan was known still hold version 2.
    assert_loaded(net, opt, state, 4 if at == "planned" else 2)
    assert "damaged" not in caplog.text and "skipping" not in caplog.text, caplog.text
    if at == "planned":
        assert "is gone (deleted by a live writer's retention" in caplog.text, caplog.text


def test_a_version_asked_for_and_pruned_is_named_gone(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, 1)
    _save(root, 2)
    net, opt, state = fresh_state()
    reader = StorageReader(root, version=2)
    prune = lambda: (_save(root, 3), _save(root, 4))  # noqa: E731
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=reader, planner=PrunesAt("planned", prune))
    error = _failure(info.value)
    assert type(error) is CheckpointError and not isinstance(error, CorruptCheckpoint)
    assert "version 2 was deleted by a live writer's retention" in str(error), error
    assert "load again" in str(error) and "\n" not in str(error)
    # Asked for and pruned only as the read begins: the held files still read it.
    _save(root, 5)
    net, opt, state = fresh_state()
    prune = lambda: (_save(root, 6), _save(root, 7))  # noqa: E731
    dcp.load(state, storage_reader=StorageReader(root, version=5), planner=PrunesAt("read", prune))
    assert_loaded(net, opt, state, 5)


def _writer(root: Path, world_size: int) -> list[subprocess.Popen]:
    """``world_size`` gloo ranks saving versions 1, 2, ... with ``keep_last=1`` until killed."""
    env = {
        **base_env(),
        "WORLD_SIZE": str(world_size),
        "MASTER_PORT": str(free_port()),
        "DCP_TEST_STEPS": "100000",
    }
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.integrations.dcp_ranks", "sharded_saves", str(root)],
            cwd=REPO,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            stderr=subprocess.STDOUT if r == 0 else subprocess.DEVNULL,
            text=True,
        )
        for r in range(world_size)
    ]


@pytest.mark.slow
def test_loads_beside_a_two_rank_save_loop_never_fail(tmp_path: Path) -> None:
    """A 2-rank writer commits and prunes (records, then each rank's shards) as fast as it
    can while this process loads again and again, pausing for a random while once the plan
    is made or as the read begins (where a save or two commit and prune meanwhile): every
    load is one whole version."""
    root = tmp_path / "ckpt"
    rng = random.Random(40)
    ranks = _writer(root, 2)
    try:
        assert ranks[0].stdout is not None
        for line in ranks[0].stdout:  # the first version is committed
            if line.startswith("committed 2"):
                break
        else:
            pytest.fail(f"the writer ended: {[r.wait() for r in ranks]}")
        # At least 5 s of loads, and on until they have read four versions (the writer
        # committed and pruned meanwhile): a fixed 5 s held four loads on a busy machine.
        steps, began = [], time.monotonic()
        while time.monotonic() < began + 5.0 or len(set(steps)) <= 3:
            assert time.monotonic() < began + LOADING, f"{steps} read in {LOADING:.0f} s"
            net, opt, state = fresh_state()
            state["sharded"] = torch.zeros(SHARDED)
            pause = rng.choice([0.0, 0.1, 0.3])
            planner = PrunesAt(rng.choice(["planned", "read"]), lambda p=pause: time.sleep(p))
            try:
                dcp.load(state, storage_reader=StorageReader(root), planner=planner)
            except CheckpointException as exc:
                raise AssertionError(f"load {len(steps) + 1} failed: {_failure(exc)!r}") from None
            assert_loaded(net, opt, state, state["step"])
            assert torch.equal(state["sharded"], sharded_value(state["step"]))
            steps.append(state["step"])
        assert all(r.poll() is None for r in ranks), "the writer stopped"
    finally:
        for r in ranks:
            r.send_signal(signal.SIGKILL)
            r.wait()
    assert len(set(steps)) > 3, steps  # the writer did commit (and prune) meanwhile
