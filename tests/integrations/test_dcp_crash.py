"""A process SIGKILLed in the middle of ``dcp.save`` leaves the previous version loadable."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pcframe.apps import cli
from pcframe.integrations.dcp import StorageReader, StorageWriter
from tests.distributed.launch import REPO, base_env
from tests.integrations.dcp_ranks import assert_loaded, fresh_state, run_ranks, training_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _check_survivor(root: Path, committed: int) -> None:
    """The newest loadable version is whole; it is the last save the child saw return, or
    the one it was in if the kill came after that version's commit point."""
    net, opt, state = fresh_state()
    state["padding"] = torch.zeros(1)  # resized by the load below
    reader = StorageReader(root)
    metadata = reader.read_metadata()
    state["padding"] = torch.zeros(metadata.state_dict_metadata["padding"].size)
    dcp.load(state, storage_reader=StorageReader(root))
    step = state["step"]
    assert step in (committed, committed + 1), (step, committed)
    assert_loaded(net, opt, state, step)
    assert torch.all(state["padding"] == float(step))
    assert cli.main(["verify", str(root)]) == 0
    # The next writer removes the leftovers and numbers above everything already used.
    dcp.save(training_state(9), storage_writer=StorageWriter(root, step=9))
    assert not list(root.glob("*.tmp")) and not list(root.glob(".trash-*"))
    _load_step(root, 9)


def _load_step(root: Path, step: int) -> None:
    net, opt, state = fresh_state()
    dcp.load(state, storage_reader=StorageReader(root))
    assert_loaded(net, opt, state, step)


def _committed(output: str) -> int:
    steps = [int(line.split()[1]) for line in output.splitlines() if line.startswith("committed")]
    return max(steps, default=0)


def _crash_at(tmp_path: Path, point: str) -> None:
    root = tmp_path / "ckpt"
    ((rc, output),) = run_ranks(1, "saves", root, env={"PCFRAME_CRASH_AT": point})
    assert rc == -signal.SIGKILL, f"rc {rc}: {output[-2000:]}"
    committed = _committed(output)
    assert committed >= 1, output[-2000:]
    _check_survivor(root, committed)


# chunk_written:8 falls inside the second version's data (about 6 chunks of 4 KiB each).
@pytest.mark.parametrize("point", ["chunk_written:8", "manifest_written:2", "published:2"])
@pytest.mark.slow
def test_crash_point_mid_save(tmp_path: Path, point: str) -> None:
    _crash_at(tmp_path, point)


@pytest.mark.campaign
@pytest.mark.parametrize(
    "point", ["data_synced:2", "latest_written:2", "retention:1", "trash_renamed:1"]
)
def test_crash_point_campaign(tmp_path: Path, point: str) -> None:
    _crash_at(tmp_path, point)


def _kill_at_random(tmp_path: Path, seed: int) -> None:
    """An outside SIGKILL at a random moment while 8 MiB versions are being saved."""
    root = tmp_path / "ckpt"
    env = {**base_env(), "DCP_TEST_STEPS": "40", "DCP_TEST_PADDING": str(2 << 20)}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.integrations.dcp_ranks", "saves", str(root)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert child.stdout is not None
    lines = []
    for line in child.stdout:
        lines.append(line)
        if line.startswith("committed 2"):
            time.sleep(random.Random(seed).uniform(0.0, 0.3))
            child.send_signal(signal.SIGKILL)
            break
    lines += child.stdout.readlines()
    assert child.wait(timeout=60) == -signal.SIGKILL, "".join(lines)[-2000:]
    _check_survivor(root, _committed("".join(lines)))


@pytest.mark.slow
def test_outside_sigkill_at_a_random_moment(tmp_path: Path) -> None:
    _kill_at_random(tmp_path, seed=int(time.time()))


@pytest.mark.campaign
@pytest.mark.parametrize("seed", range(8))
def test_outside_sigkill_campaign(tmp_path: Path, seed: int) -> None:
    _kill_at_random(tmp_path, seed)
