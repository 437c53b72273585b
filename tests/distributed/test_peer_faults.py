"""The peer tier under faults and habits: a preemption notice on one node, a slow peer, a
restart on fewer nodes, a node killed at a random moment (4 real gloo ranks as 2 "nodes");
ranks given different peer options."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from pcframe.distributed import global_versions as rec
from tests.distributed.nodes_kit import NODES, final, job, lose_node


@pytest.mark.slow
def test_a_notice_on_one_node_secures_its_newest_state_on_a_peer_first(tmp_path):
    """Rank 2's VM gets a notice at step 5 (between periodic saves): every rank saves, and
    rank 2 learns its shard of that version is in a peer's memory before it goes on."""
    runs = job(
        tmp_path, tmp_path / "ckpt", "notice", 6, "--emergency-at", "5", "--emergency-rank", "2"
    )
    version, tiers, durable = runs[2]["secured"]
    assert tiers == ["peers"] and durable, runs[2]
    copy = tmp_path / "ckpt" / "a-shm" / "kept-by-rank-0" / "rank-2" / f"v{version:08d}"
    assert (copy / "manifest.json").is_file()


@pytest.mark.slow
def test_a_notice_the_policy_does_not_save_for_secures_the_newest_global_version(tmp_path):
    """Rank 3's VM gets a notice at step 7, which its policy (a save every 3 steps) does not
    read: no save is made, and every rank sends the newest global version (step 6's) where
    it outlives the VM, the peer tier first; a notice at a routine save's step (9) is that
    save's to secure."""
    runs = job(tmp_path, tmp_path / "ckpt", "quiet", 8, "--notice-at", "7", "--notice-rank", "3")
    assert runs[3]["versions"] == [1, 2]  # steps 3 and 6: the notice added no save
    for run in runs:  # the meeting told every rank
        assert run["secured"] == [2, ["peers"], True], run
    copy = tmp_path / "ckpt" / "a-shm" / "kept-by-rank-1" / "rank-3" / "v00000002"
    assert (copy / "manifest.json").is_file()
    runs = job(tmp_path, tmp_path / "ckpt2", "routine", 9, "--notice-at", "9", "--notice-rank", "1")
    assert runs[1]["versions"] == [1, 2, 3] and runs[1]["secured"] == [3, ["peers"], True]


@pytest.mark.slow
def test_a_slow_peer_costs_copies_not_training_time(tmp_path):
    """Rank 3 keeps no copy it receives until every rank has trained all its steps, saving
    at every step: the training loop is not held up by it (every rank trains to the end
    while rank 3 holds its first copy; the held copy waits for that, not for its 120 s
    deadline), versions queued meanwhile are superseded by newer ones, and the newest still
    reaches every peer by the close."""
    runs = job(tmp_path, tmp_path / "ckpt", "slow", 12, "--every", "1", "--slow-peer", "3")
    assert "peer_held_past_training" not in runs[3], [r["slowest_call"] for r in runs]
    assert all(r["slowest_call"] < 60 for r in runs), [r["slowest_call"] for r in runs]
    assert any(r["skipped"] > 0 for r in runs), runs  # superseded while rank 3 lagged
    assert all(12 in r["copied"] for r in runs)  # the newest version is on its peers


@pytest.mark.slow
def test_a_restart_on_fewer_nodes_reshards_reading_the_copies_in_its_memory(tmp_path, reference):
    """Node b is gone for good: the job goes on with node a's 2 ranks, reading b's shards
    from the copies in a's memory, and the state is laid out for 2 ranks (resharded)."""
    root = tmp_path / "ckpt"
    job(tmp_path, root, "first", 9)
    lose_node(root, "b")
    runs = job(tmp_path, root, "two", 9, nodes={0: "a", 1: "a"})
    assert [r["restored_step"] for r in runs] == [9, 9]
    assert runs[0]["shard_sources"] == {
        "0": "local disk",
        "1": "local disk",
        "2": "peer memory",
        "3": "peer memory",
    }
    for rank in (0, 1):  # model and optimizer as the 4-rank run had them at step 9
        expected = final(reference, "reference", rank, 9)
        got = load_file(tmp_path / "out" / f"nodes-two-r{rank}-at9.safetensors")
        for key in expected:
            if key.startswith(("model/", "optimizer/", "scheduler/")):
                assert torch.equal(expected[key], got[key]), (rank, key)


@pytest.mark.slow
def test_a_node_killed_at_a_random_moment_comes_back_from_what_was_secured(tmp_path, reference):
    """SIGKILL node b's ranks at a random moment (in a save, a copy, between them), then
    the VM is gone; the job restarts and restores the newest version every shard of which
    survived, exactly as the uninterrupted run had it, losing at most two intervals."""
    import random
    import signal
    import time

    from tests.distributed.launch import REPO, base_env, free_port
    from tests.warm import WarmProcess

    rng = random.Random(7)
    out, root = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    env = {**base_env(), "WORLD_SIZE": "4", "MASTER_PORT": str(free_port())}
    args = ["nodes", "--root", str(root), "--out", str(out), "--tag", "killed", "--steps", "60"]
    procs = []
    for rank, node in NODES.items():
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "PCFRAME_NODE": node}
        log = tmp_path / f"killed-{rank}.log"
        procs.append(WarmProcess("tests.distributed.worker", args, env=rank_env, cwd=REPO, log=log))
    first_record = root / "a" / "global" / "v00000001.json"
    deadline = time.monotonic() + 120
    while not first_record.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.5))
    for proc in procs[2:]:
        proc.send_signal(signal.SIGKILL)  # node b's VM is taken
    for proc in procs:  # the launcher ends the rest of the job
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lose_node(root, "b")
    copies = root / "a-shm"
    had = [  # the global versions whose lost shards both had a copy on node a
        v
        for v in rec.record_versions(root / "a")
        if all(list(copies.glob(f"kept-by-rank-*/rank-{r}/v{v:08d}")) for r in (2, 3))
    ]
    assert had, "no version was secured on a peer before the kill"
    resumed = job(tmp_path, root, "after", 60)
    restored = resumed[0]["restored_step"]
    assert [r["restored_step"] for r in resumed] == [restored] * 4
    assert restored == 3 * max(had)  # the newest version every shard of which survived
    for rank in range(4):
        expected = final(reference, "reference", rank, restored)
        got = final(tmp_path, "after", rank, restored)
        for key in expected:
            assert torch.equal(expected[key], got[key]), (rank, key)


@pytest.mark.slow
def test_with_two_replicas_two_nodes_lost_come_back_from_the_third_nodes_memory(tmp_path):
    """3 nodes of one rank, ``replicas=2``: every rank keeps copies of both others' shards
    (room made for both in each round). Nodes b and c are lost: node a alone brings the
    job back from its disk and its memory, bit for bit, with no object store."""
    three = {0: "a", 1: "b", 2: "c"}
    root = tmp_path / "ckpt"
    first = job(tmp_path, root, "first", 9, "--replicas", "2", "--wait-peers", nodes=three)
    assert all(r["copied"] == [1, 2, 3] for r in first), first
    kept = sorted(p.relative_to(root / "a-shm").parts[1:] for p in root.glob("a-shm/*/rank-*/v*"))
    both = [(f"rank-{src}", f"v{v:08d}") for src in (1, 2) for v in (2, 3)]
    assert kept == both  # both others' shards, keep=2 each
    lose_node(root, "b")
    lose_node(root, "c")
    resumed = job(tmp_path, root, "resumed", 12, "--replicas", "2", nodes=three)
    assert [r["restored_step"] for r in resumed] == [9] * 3
    assert all(r["remote_bytes"] == 0 for r in resumed)
    assert resumed[0]["shard_sources"] == {
        "0": "local disk",
        "1": "peer memory",
        "2": "peer memory",
    }
    for rank in range(3):
        expected, got = final(tmp_path, "first", rank, 9), final(tmp_path, "resumed", rank, 9)
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[k], got[k]) for k in expected), rank


MISMATCHED = textwrap.dedent(
    """
    import sys, time, torch
    import torch.distributed as dist
    from pcframe.distributed import DistributedCheckpointer
    from pcframe.errors import CheckpointError

    root, rendezvous, peer_dir, rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=2)
    start = time.monotonic()
    try:
        DistributedCheckpointer(
            root, model=torch.nn.Linear(2, 2), replicas=1 - rank, peer_dir=peer_dir,
            protocol_timeout=600,
        )
        print("opened")
    except CheckpointError as exc:
        print(f"{time.monotonic() - start:.1f} {exc}")
    dist.destroy_process_group()
    """
)


def test_ranks_given_different_replicas_are_refused_on_every_rank_at_open(tmp_path):
    """Rank 0 replicated, rank 1 did not: the save stalled in a peer round rank 1 never
    entered (until protocol_timeout: 30 min by default), and a restore crossed collectives
    (a raw AttributeError). Now every rank refuses the open at once, naming the option."""
    args = [str(tmp_path / "ckpt"), str(tmp_path / "rdv")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MISMATCHED, *args, str(tmp_path / f"shm-{rank}"), str(rank)],
            env={**os.environ, "PCFRAME_NODE": "ab"[rank]},
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for out in outputs:
        assert "different DistributedCheckpointer options: replicas (rank 0: 1, rank 1: 0)" in out
        assert float(out.split()[0]) < 60  # at once, not after the protocol timeout


ONE_RANK_REFUSES = textwrap.dedent(
    """
    import sys, torch
    import torch.distributed as dist
    from pcframe.distributed import DistributedCheckpointer

    class Refusing:
        def __init__(self, refuse): self.refuse = refuse
        def state_dict(self): return {"n": 1}
        def load_state_dict(self, state):
            if self.refuse: raise RuntimeError("this rank's object refuses")

    from pcframe.policies import FixedSteps

    class RefusingPolicy(FixedSteps):
        def __init__(self, refuse):
            super().__init__(100)
            self.refuse = refuse
        def observe(self, event):
            if self.refuse and type(event).__name__ == "Restarted":
                raise RuntimeError("this rank's policy refuses")
            super().observe(event)

    root, rendezvous, rank, case = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    adam = case == "save" or rank == 0 or case != "optimizer"
    opt = (torch.optim.AdamW if adam else torch.optim.SGD)(model.parameters(), lr=0.1)
    refusing = Refusing(case == "object" and rank == 1)
    policy = RefusingPolicy(case == "policy" and rank == 1)
    with DistributedCheckpointer(root, model=model, optimizer=opt, stateful={"o": refusing},
                                 replicas=0, policy=policy) as ckpt:
        if case == "save":
            model(torch.ones(3)).sum().backward()
            opt.step()
            ckpt.save(1).wait()
        else:
            with torch.no_grad():
                model.weight.fill_(7.0)
            try:
                ckpt.restore()
                print("restored")
            except Exception as exc:
                print(type(exc).__name__, str(exc).splitlines()[0])
            print("weight", float(model.weight[0, 0]))
    dist.destroy_process_group()
    """
)


def _two_ranks_of(script: str, tmp_path, case: str) -> list[str]:
    args = [str(tmp_path / "ckpt"), str(tmp_path / f"rdv-{case}")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args, str(rank), case],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    return [p.communicate(timeout=120)[0] for p in procs]


@pytest.mark.slow  # ~30 s: three jobs of four ranks
def test_a_restore_one_rank_refuses_stops_every_rank_and_none_is_loaded(tmp_path):
    """Rank 1 given SGD for a version of AdamW state: it refused at the apply while rank 0
    loaded the version, said it resumed, and trained into a collective rank 1 never joined
    (a raw gloo error, or a 30-minute NCCL timeout). The fit is checked before the ranks
    agree: every rank refuses, none loads. A load_state_dict of the user's raising on one
    rank (not foreseeable), or its policy refusing the restart, stops every rank too, naming
    it."""
    _two_ranks_of(ONE_RANK_REFUSES, tmp_path, "save")
    outputs = _two_ranks_of(ONE_RANK_REFUSES, tmp_path, "optimizer")
    assert all("weight 7.0" in out for out in outputs), outputs  # nothing loaded anywhere
    assert all("does not fit the objects given" in out for out in outputs), outputs
    assert "rank 1:" in outputs[0]
    outputs = _two_ranks_of(ONE_RANK_REFUSES, tmp_path, "object")
    assert "rank 1 could not load global version 1" in outputs[0], outputs[0]
    assert "this rank's object refuses" in outputs[1] and "weight 7.0" in outputs[1]
    # ... and a policy of the user's refusing the Restarted event after the apply
    outputs = _two_ranks_of(ONE_RANK_REFUSES, tmp_path, "policy")
    assert "rank 1 could not load global version 1" in outputs[0], outputs[0]
    assert "this rank's policy refuses" in outputs[1], outputs[1]


@pytest.mark.slow
def test_a_notice_while_a_commit_round_cannot_finish_is_answered_within_its_window(tmp_path):
    """Rank 1's disk holds its shard of version 2 (step 6) until rank 1 has answered the
    notice rank 3's VM gets at step 7 (a 10 s window): version 2's commit round cannot be
    decided in that window. Every rank waited for that round, rank 1 for itself, until the
    hold gave up after 120 s, the VM long gone. Now every rank answers within the window,
    all secure version 1 (the newest global on every rank) and say why not version 2, and
    the job trains on: version 2 becomes global once the disk lets go, and version 3."""
    window = 10.0
    runs = job(
        tmp_path,
        tmp_path / "ckpt",
        "held",
        9,
        *("--notice-at", "7", "--notice-rank", "3", "--notice-window", str(window)),
        *("--hold-version", "2", "--hold-rank", "1", "--wait-peers"),
    )
    for run in runs:
        assert run["notice_call"] < window + 15, run  # not the hold's 120 s
        assert run["secured"] == [1, ["peers"], True], run
        reason = run["secured_reason"]
        assert "the commit round of version 2 was not decided" in reason, reason
        assert "rank(s) 1 had not finished writing their shard" in reason, reason
        assert "rank(s) 0, 2, 3 were waiting for the other ranks" in reason, reason
        assert run["globals"][-2:] == [2, 3], run  # trained on: version 2 became global, then 3
    assert runs[1]["versions"] == [1, 2, 3]


@pytest.mark.slow
def test_an_emergency_version_not_global_within_the_notices_window_is_said_so(tmp_path):
    """Rank 3's VM gets a notice (a 10 s window) at step 6, where the job saves anyway: the
    save is an emergency one, waited for until global. Rank 1's disk holds its shard of that
    version until rank 1 has answered the notice, so it cannot become global in the window.
    Every rank waited for it without a bound (until the hold gave up after 120 s, the VM
    long gone); now every rank answers within the window, says nothing was secured and why,
    and the job trains on: the version becomes global once the disk lets go."""
    window = 10.0
    runs = job(
        tmp_path,
        tmp_path / "ckpt",
        "held-emergency",
        9,
        *("--notice-at", "6", "--notice-rank", "3", "--notice-window", str(window)),
        *("--hold-version", "2", "--hold-rank", "1", "--wait-peers"),
    )
    for run in runs:
        assert run["notice_call"] < window + 15, run  # not the hold's 120 s
        assert run["secured"] == [2, [], False], run
        reason = run["secured_reason"]
        assert "emergency version 2 was not global within the notice's window" in reason, reason
        assert run["globals"][-2:] == [2, 3], run  # trained on: version 2 became global, then 3
    assert "this rank's shard still being written" in runs[1]["secured_reason"]


@pytest.mark.slow
def test_a_notice_after_a_restart_secures_the_version_it_restored(tmp_path):
    """The job restarts on the same VMs, whose memory was wiped (no peer holds a copy), and
    restores version 2 (step 6); rank 3's VM gets a notice at step 7, which the policy does
    not save for. Only versions published by this process counted, so nothing was secured
    and the VM took its shards with it; now the restored version counts as the newest: it is
    given to the peer tier and secured on every rank."""
    import shutil

    root = tmp_path / "ckpt"
    job(tmp_path, root, "first", 6)
    for node in ("a", "b"):
        shutil.rmtree(root / f"{node}-shm")
    runs = job(tmp_path, root, "again", 8, "--notice-at", "7", "--notice-rank", "3")
    for run in runs:
        assert run["restored_step"] == 6 and "versions" not in run, run  # no save since
        assert run["secured"] == [2, ["peers"], True], run
    for rank, keeper in ((0, 2), (1, 3), (2, 0), (3, 1)):  # every shard has a copy
        copy = root / f"{'ab'[keeper // 2]}-shm" / f"kept-by-rank-{keeper}" / f"rank-{rank}"
        assert (copy / "v00000002" / "manifest.json").is_file(), (rank, keeper)


LATE_TO_AGREE = textwrap.dedent(
    """
    import json, sys, time, torch
    from pathlib import Path
    import torch.distributed as dist
    from pcframe.distributed import DistributedCheckpointer

    root, rendezvous, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    returned = Path(sys.argv[4])
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=2)
    with DistributedCheckpointer(root, model=torch.nn.Linear(2, 2), replicas=0) as ckpt:
        ckpt.save(1).wait()
        ckpt.save(2).wait()
        dist.barrier()
        # The notice's deadline on the wall clock, the same on both ranks (the meeting's).
        deadline = [time.time() + 3.0]
        dist.broadcast_object_list(deadline)
        deadline = deadline[0]
        if rank == 1:  # stuck (a long pause of its VM) until rank 0 has given up
            while not returned.exists() and time.time() < deadline + 60:
                time.sleep(0.01)
        try:
            secured = ckpt.securing.secure_newest(deadline, floor=1)
            late = time.time() - deadline
        finally:
            if rank == 0:
                returned.touch()
        print(json.dumps([secured.version, secured.reason, late]))
    dist.destroy_process_group()
    print("closed")
    """
)


SKEWED_AGREEMENT = textwrap.dedent(
    """
    import json, shutil, sys, time, torch
    import torch.distributed as dist
    from pathlib import Path
    from pcframe.distributed import DistributedCheckpointer

    base, rendezvous, rank, phase = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    before = float(sys.argv[5])  # s before the deadline rank 1 comes to the agreement
    node = "ab"[rank]
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=2)
    torch.manual_seed(0)
    options = dict(replicas=1, node=node, peer_dir=base / f"{node}-shm")
    with DistributedCheckpointer(base / node, model=torch.nn.Linear(2, 2), **options) as ckpt:
        if phase == "first":
            for step in (1, 2):
                ckpt.save(step).wait()
                assert ckpt.peers.wait(step, timeout=60)
        else:
            restored = ckpt.restore()
            deadline = [time.time() + 8.0]  # the meeting's, the same on both ranks
            dist.broadcast_object_list(deadline)
            deadline = deadline[0]
            if rank == 1:  # a pause of its VM between the meeting and the agreement
                time.sleep(max(0.0, deadline - before - time.time()))
            secured = ckpt.securing.secure_newest(deadline, floor=restored)
            for step in (3, 4):
                ckpt.save(step).wait()
                assert ckpt.peers.wait(ckpt.global_versions()[-1], timeout=60)
            status = ckpt.peers.status
            print(json.dumps([secured.version, secured.reason, list(status.copied), status.broken]))
    dist.destroy_process_group()
    """
)


def _two_ranks(script: str, *args: str) -> list[str]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, args[0], args[1], str(rank), *args[2:]],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    return outputs


@pytest.mark.slow  # 13-17 s each: four ranks, one of them held until the deadline
@pytest.mark.parametrize("before", [6.0, 0.4])
def test_ranks_that_reach_a_notices_agreement_apart_take_one_answer_and_replicate_on(
    tmp_path, before
):
    """A restarted job (its peers' memory wiped) restores version 2; a notice is answered
    without a save, and rank 1 comes to the agreement on the version to secure ``before`` s
    before the notice's deadline (a pause of its VM). Well before it: both take the answers.
    Within the last second: both refuse them, the late rank too (rank 0 had given up before
    on its own clock, rank 1 took the answers: their peer tiers then disagreed on what they
    were given and replication stopped for good on both). Either way both secure the same
    version, the restored one is given to the peers on both, and later versions replicate."""
    base, rendezvous = tmp_path / "ckpt", tmp_path / "rdv"
    _two_ranks(SKEWED_AGREEMENT, str(base), str(rendezvous), "first", "0")
    for node in "ab":
        shutil.rmtree(base / f"{node}-shm")
    rendezvous.unlink(missing_ok=True)
    outputs = _two_ranks(SKEWED_AGREEMENT, str(base), str(tmp_path / "rdv2"), "again", str(before))
    results = [json.loads(out.splitlines()[-1]) for out in outputs]
    for version, reason, copied, broken in results:
        assert version == 2, results
        assert broken in (None, "", False), results
        assert {2, 3, 4} <= set(copied), results
        if before < 1.0:  # within the margin (or past the deadline, on a busy machine)
            assert "the ranks did not agree on the version to secure" in reason, results
        else:
            assert "did not agree" not in reason, results


def test_a_rank_late_to_a_notices_agreement_secures_what_the_others_do(tmp_path):
    """After a notice's meeting, rank 1 does not come to the agreement on the version to
    secure before the window ends. Rank 0 gives up at the window's end and secures the
    version every rank knew at the meeting (1), not the newest it knows (2); rank 1, late,
    finds the agreement complete (rank 0 had answered) but after the window, and takes the
    same fallback, so the ranks never secure different versions; both close cleanly (the
    agreement rank 0 left did complete)."""
    returned = tmp_path / "returned"
    root, rendezvous = str(tmp_path / "ckpt"), str(tmp_path / "rdv")
    outputs = _two_ranks(LATE_TO_AGREE, root, rendezvous, str(returned))
    results = [json.loads(out.splitlines()[0]) for out in outputs]
    for version, reason, _ in results:
        assert version == 1, results
        assert "the ranks did not agree on the version to secure" in reason, reason
    assert 0 <= results[0][2] < 10, results  # rank 0 waited out the window, not longer
    assert all(out.splitlines()[-1] == "closed" for out in outputs), outputs
