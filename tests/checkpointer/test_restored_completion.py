"""A restored policy learns what the save of its version cost.

Its state was taken when that save started, so it never saw the save finish: without being
told, a process restored from a version written by a process that made one save plans with
the configured priors, and so does every process after it while lives stay that short. The
engine records the save's cost in the version's manifest and tells the policy on restore,
before ``Restarted``; the simulator does the same (``tests/sim/test_learning_inputs.py``).
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from pcframe import Checkpointer
from pcframe.decisions import recorded_completion
from pcframe.format.manifest import read_manifest
from pcframe.policies import Daly
from pcframe.policies.base import Restarted, SaveCompleted
from pcframe.save.progress import COST_KEY


class Recording(Daly):
    """Daly that keeps every event it is told (outside its state)."""

    def __init__(self) -> None:
        super().__init__(mtbf=3600.0)
        self.events: list[object] = []

    def observe(self, event) -> None:
        self.events.append(event)
        super().observe(event)


def write_and_die(root, steps: list[int]) -> None:
    """A separate process saves ``steps`` (one version each, waited for) with Daly, then is
    SIGKILLed."""
    script = textwrap.dedent(
        """
        import os, signal, sys, torch
        from pcframe import Checkpointer
        from pcframe.policies import Daly
        ckpt = Checkpointer(sys.argv[1], model=torch.nn.Linear(64, 64), policy=Daly(mtbf=3600.0))
        for step in map(int, sys.argv[2:]):
            ckpt.save(step).wait()
            ckpt.decide(step + 1)  # the engine reports the commit to the policy here
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    args = [sys.executable, "-c", script, str(root), *map(str, steps)]
    subprocess.run(args, timeout=120, check=False)


def restore(root) -> Recording:
    policy = Recording()
    with Checkpointer(root, model=torch.nn.Linear(64, 64), policy=policy) as ckpt:
        ckpt.restore()
    return policy


def test_the_restored_version_s_save_is_reported_before_the_restart(tmp_path):
    write_and_die(tmp_path, [7])  # one save: the version's state knows no save's cost
    policy = restore(tmp_path)
    completed, restarted = policy.events
    assert isinstance(completed, SaveCompleted) and isinstance(restarted, Restarted)
    recorded = read_manifest(str(tmp_path / "v00000001" / "manifest.json")).engine[COST_KEY]
    assert (completed.version, completed.step, restarted.step) == (1, 7, 7)
    assert (completed.stall, completed.duration) == (recorded["stall"], recorded["durable"])
    assert completed.nbytes == recorded["nbytes"] > 64 * 64 * 4
    assert 0.0 < completed.duration < 60.0 and completed.stall <= completed.duration
    # The policy plans with it, not with its prior (10 s to durable).
    assert policy.costs.duration.count == 1
    assert policy.costs.duration.mean == completed.duration


def test_each_save_is_learnt_once_across_the_restart(tmp_path):
    write_and_die(tmp_path, [3, 5])  # v2's state holds v1's completion, not its own
    policy = restore(tmp_path)
    assert [type(e) for e in policy.events] == [SaveCompleted, Restarted]
    assert policy.events[0].version == 2
    assert policy.costs.duration.count == 2  # v1's (in the state) and v2's (reported)


def test_a_version_without_a_recorded_cost_reports_only_the_restart():
    assert recorded_completion({"writer": 3}, 7, 1.0) is None  # an older writer's manifest


def valid() -> dict:
    return {"version": 2, "stall": 0.5, "durable": 1.5, "nbytes": 1024}


@pytest.mark.parametrize(
    "change",
    [
        {"version": 0},
        {"version": "two"},
        {"stall": -1.0},
        {"durable": math.nan},
        {"durable": math.inf},
        {"nbytes": -5},
        {"stall": None},
    ],
)
def test_a_recorded_cost_no_save_has_is_ignored_with_a_warning(change, caplog):
    record = {**valid(), **change}
    with caplog.at_level(logging.WARNING, logger="pcframe"):
        assert recorded_completion({COST_KEY: record}, 7, 1.0) is None
    (message,) = [r.getMessage() for r in caplog.records]
    assert "ignored" in message and "manifest" in message


@pytest.mark.parametrize("record", [[1, 2], "costly", 3])
def test_a_recorded_cost_of_the_wrong_shape_is_ignored(record, caplog):
    with caplog.at_level(logging.WARNING, logger="pcframe"):
        assert recorded_completion({COST_KEY: record}, 7, 1.0) is None
    assert len(caplog.records) == 1


def test_a_valid_record_becomes_the_completion():
    event = recorded_completion({COST_KEY: valid()}, 7, 9.0)
    assert event == SaveCompleted(version=2, step=7, time=9.0, stall=0.5, duration=1.5, nbytes=1024)
