"""A signal handler's collective call on one rank, in the middle of another: refused at once.

Two real gloo ranks. Rank 0's handler (the plain one, ``ckpt.save(step).wait()``) runs in
the middle of its ``maybe_save``, between the local decision and the meeting of all ranks.
Run there, the save entered a collective the other rank was not in, and the ranks went out
of step or waited for each other. It is refused with one line naming the fix, before the
interrupted call's collective; rank 0 calls ``maybe_save`` again, meets rank 1 in the call
it is waiting in, and the job goes on and ends cleanly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

RANK = textwrap.dedent(
    """
    import json, signal, sys, torch
    import torch.distributed as dist
    from pcframe.distributed import DistributedCheckpointer
    from pcframe.errors import CheckpointError
    from pcframe.policies import FixedSteps

    root, rendezvous, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ckpt = DistributedCheckpointer(root, model=model, policy=FixedSteps(1), protocol_timeout=60)
    refused = []
    if rank == 0:
        signal.signal(signal.SIGUSR1, lambda *_: ckpt.save(99).wait())
        decide, fired = ckpt.local.decide, []

        def interrupted(step, *args, **kwargs):  # the handler lands here, before the meeting
            if step == 2 and not fired:
                fired.append(step)
                signal.raise_signal(signal.SIGUSR1)
            return decide(step, *args, **kwargs)

        ckpt.local.decide = interrupted
    for step in (1, 2, 3):
        while True:
            try:
                ckpt.maybe_save(step)
                break
            except CheckpointError as exc:  # refused: the same call again, in step
                refused.append(str(exc))
    ckpt.wait()
    print(json.dumps({"refused": refused, "versions": ckpt.global_versions()}))
    ckpt.close()
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_collective_from_a_handler_in_the_middle_of_another_is_refused(tmp_path, child_env):
    args = [str(tmp_path / "ckpt"), str(tmp_path / "rendezvous")]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, *args, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env,
        )
        for rank in range(2)
    ]
    results = []
    try:
        for process in ranks:
            out, err = process.communicate(timeout=150)  # a hang fails here
            assert process.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.communicate()
    (line,) = results[0]["refused"]
    assert line.startswith(
        "DistributedCheckpointer.save() was called while maybe_save() runs on this thread"
    )
    assert "SignalNoticeSource" in line and "\n" not in line
    assert results[1]["refused"] == []
    assert results[0]["versions"] == results[1]["versions"] == [2, 3]  # every step saved
