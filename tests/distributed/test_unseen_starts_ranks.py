"""A multi-rank restore reports the writers that died unseen, as a one-rank restore does.

Real processes, each a world of one gloo rank, SIGKILLed after their work.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

LIFE = textwrap.dedent(
    """
    import json, os, signal, sys, torch
    import torch.distributed as dist
    from pcframe.distributed import DistributedCheckpointer
    from pcframe.policies import FixedSteps
    from pcframe.policies.base import Restarted

    class Recording(FixedSteps):
        def __init__(self):
            super().__init__(100)
            self.events = []

        def observe(self, event):
            self.events.append(event)
            super().observe(event)

    root, rendezvous, action = sys.argv[1:4]
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=0, world_size=1)
    policy = Recording()
    ckpt = DistributedCheckpointer(root, model=torch.nn.Linear(2, 2), policy=policy)
    step = ckpt.restore()
    if action == "save":
        ckpt.save(7).wait()
    if action == "report":
        events = [e for e in policy.events if isinstance(e, Restarted)]
        print(json.dumps([step, [(e.clean, e.unseen_starts) for e in events]]))
        ckpt.close()
        dist.destroy_process_group()
        sys.exit(0)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def life(tmp_path, n: int, action: str) -> str:
    args = [str(tmp_path / "ckpt"), str(tmp_path / f"rendezvous{n}"), action]
    done = subprocess.run(
        [sys.executable, "-c", LIFE, *args], capture_output=True, text=True, timeout=120
    )
    return done.stdout


@pytest.mark.slow
def test_multi_rank_restore_counts_writers_that_died_unseen(tmp_path):
    life(tmp_path, 1, "save")  # commits global version 1, then is killed
    life(tmp_path, 2, "die")  # killed before committing
    life(tmp_path, 3, "die")
    step, events = json.loads(life(tmp_path, 4, "report"))
    # Three deaths since the version: the newest is the Restarted itself, two are unseen.
    assert step == 7 and events == [[False, 2]]


@pytest.mark.slow
def test_nothing_restored_still_reports_the_dead_writers(tmp_path):
    life(tmp_path, 1, "die")
    life(tmp_path, 2, "die")
    step, events = json.loads(life(tmp_path, 3, "report"))
    assert step is None and events == [[False, 1]]


BAD_OBJECT = textwrap.dedent(
    """
    import sys, torch
    import torch.distributed as dist
    from pcframe.distributed import DistributedCheckpointer

    class Position:
        def state_dict(self):
            return {"at": 3}

        def load_state_dict(self, state):
            pass

    root, rendezvous = sys.argv[1:3]
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=0, world_size=1)
    try:
        DistributedCheckpointer(root, model=object())
    except TypeError as exc:
        print("refused:", exc)
    # Nothing was left locked: the same root opens at once in this process (and named
    # stateful objects may come as pairs, as dict() takes them).
    ckpt = DistributedCheckpointer(
        root, model=torch.nn.Linear(2, 2), stateful=[("position", Position())]
    )
    ckpt.save(1).wait()
    assert ckpt.restore() == 1
    ckpt.close()
    dist.destroy_process_group()
    print("reopened")
    """
)


def test_objects_that_cannot_be_restored_are_refused_before_anything_is_locked(tmp_path):
    args = [str(tmp_path / "ckpt"), str(tmp_path / "rendezvous")]
    done = subprocess.run(
        [sys.executable, "-c", BAD_OBJECT, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "refused: model= is a object" in done.stdout
    assert "reopened" in done.stdout
