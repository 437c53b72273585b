"""Ctrl-C while a multi-rank restore applies: held until the restore is complete.

A real process, a world of one gloo rank; the interrupt is a real SIGINT sent to the main
thread as the verified version is being applied.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, signal, sys, threading, torch
    import torch.distributed as dist
    import pcframe.distributed.restore as restore
    from pcframe.distributed import DistributedCheckpointer

    root, rendezvous = sys.argv[1:3]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ckpt = DistributedCheckpointer(root, model=model)
    ckpt.save(1).wait()
    saved = [t.clone() for t in model.state_dict().values()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real = restore.Prepared.apply

    def interrupted(self, objects):
        real(self, objects)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    restore.Prepared.apply = interrupted
    try:
        ckpt.restore()
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    restore.Prepared.apply = real
    report = ckpt.last_restore
    print(json.dumps({
        "outcome": outcome,
        "restored": all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved)),
        "version": report.version,
        "timed": report.seconds is not None,
    }))
    ckpt.close()
    dist.destroy_process_group()
    """
)


def test_ctrl_c_while_a_multi_rank_restore_applies_completes_it_then_raises(tmp_path):
    args = [str(tmp_path / "ckpt"), str(tmp_path / "rendezvous")]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"outcome": "KeyboardInterrupt", "restored": True, "version": 1, "timed": True}


HANDLER_SAVES = textwrap.dedent(
    """
    import json, signal, sys, threading, torch
    import torch.distributed as dist
    import pcframe.distributed.restore as restore
    from pcframe.distributed import DistributedCheckpointer
    from pcframe.errors import CheckpointError

    root, rendezvous = sys.argv[1:3]
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ckpt = DistributedCheckpointer(root, model=model)
    ckpt.save(1).wait()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = [t.clone() for t in model.state_dict().values()]
    signal.signal(signal.SIGUSR1, lambda *_: ckpt.save(2).wait())
    real = restore.read_entries_into  # the live model's tensors: verified, not yet filled

    def then_signal(*args, **kwargs):  # the first read: nothing applied yet
        result = real(*args, **kwargs)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        return result

    restore.read_entries_into = then_signal
    try:
        ckpt.restore()
        outcome = "returned"
    except CheckpointError as exc:
        outcome = str(exc).split(" was called")[0]
    restore.read_entries_into = real
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    unchanged = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before))
    versions = ckpt.global_versions()
    after = ckpt.restore()
    ckpt.save(3).wait()
    print(json.dumps({
        "outcome": outcome, "unchanged": unchanged, "versions": versions, "after": after,
        "later": ckpt.global_versions(),
    }))
    ckpt.close()
    dist.destroy_process_group()
    """
)


def test_a_save_from_a_handler_during_a_multi_rank_restore_is_refused(tmp_path):
    """One rank's handler starting a collective save in the middle of a collective restore
    hung the job (the other ranks wait in the restore's collectives). It is refused, the
    restore fails changing nothing, and both work afterwards."""
    args = [str(tmp_path / "ckpt"), str(tmp_path / "rendezvous")]
    done = subprocess.run(
        [sys.executable, "-c", HANDLER_SAVES, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "outcome": "DistributedCheckpointer.save()",
        "unchanged": True,
        "versions": [1],
        "after": 1,
        "later": [1, 2],
    }
