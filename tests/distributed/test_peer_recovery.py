"""Losing a whole node: 4 real gloo ranks as 2 "nodes" that share nothing (each its own root
and memory folder), one node's folders deleted between two runs, as a preempted VM's are.

Each job runs ``tests.distributed.worker nodes``: train to ``--steps``, a version every 3
steps, restoring first. The state a restore brings back is compared bit for bit with the
uninterrupted run's at the same step; the state after training on is compared closely, not
bit for bit: gloo's all-reduce over 4 ranks sums in an order that DDP's first iteration in a
process (its bucket rebuild) changes, so 4-rank DDP on gloo is not bit-reproducible across a
restart even without a checkpoint (2 ranks are: the multi-rank tests compare those exactly).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pcframe.distributed import global_versions as rec
from tests.distributed.launch import run_job
from tests.distributed.nodes_kit import assert_same_as_reference, job, lose_node
from tests.helpers import flip_byte


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The job's first run to step 9, every version copied to a peer (``--wait-peers``),
    made once for the module: each test loses or damages its own copy of its folders."""
    tmp = tmp_path_factory.mktemp("first")
    return tmp / "ckpt", job(tmp, tmp / "ckpt", "first", 9, "--wait-peers")


def after_first_run(first_run: tuple[Path, list[dict]], tmp_path: Path) -> tuple[Path, list]:
    """A copy of the first run's roots and memory folders (modes kept: a memory folder must
    be private) in ``tmp_path``, and what its ranks reported."""
    root = tmp_path / "ckpt"
    shutil.copytree(first_run[0], root, symlinks=True)
    return root, first_run[1]


def test_a_lost_node_comes_back_from_its_peers_memory_bit_identical(tmp_path, reference, first_run):
    shutil.copytree(reference / "out", tmp_path / "out")
    root, first = after_first_run(first_run, tmp_path)
    assert all(r["copied"] == [1, 2, 3] for r in first), first  # every version on a peer
    # DDP: each rank holds the state of the rank it backs up, so after the first copy (the
    # layout) most of each copy was written from its own state, not sent (shadow.py).
    for r in first:
        assert r["shadow_bytes"] > 0.4 * r["received_bytes"], first
    lose_node(root, "b")
    resumed = job(tmp_path, root, "resumed", 12)
    assert [r["restored_step"] for r in resumed] == [9] * 4
    assert all(r["remote_bytes"] == 0 for r in resumed)  # no object store at all here
    # Node a read its own shards from disk and node b's from the copies in its memory;
    # node b had nothing: everything was sent to it (each shard once per node).
    assert resumed[0]["shard_sources"] == {
        "0": "local disk",
        "1": "local disk",
        "2": "peer memory",
        "3": "peer memory",
    }
    assert set(resumed[2]["shard_sources"].values()) == {"fetched"}
    # ... into its memory folder, not its disk; the restored version's shards stay there.
    fetched = sorted(p.name for p in (root / "b-shm" / "fetched").glob("*/rank-*/v*"))
    assert fetched == ["v00000003"] * 4, fetched
    assert not (root / "b" / ".fetched").exists()
    assert sum(r["peer_bytes"] for r in resumed[2:]) > 0
    assert sum(r["peer_bytes"] for r in resumed[:2]) == 0
    assert_same_as_reference(tmp_path, "resumed", 9)
    # The new node keeps the records again (its leader writes them).
    assert rec.record_versions(root / "b")[-1] == rec.record_versions(root / "a")[-1] == 4


def test_what_is_planted_in_the_fetched_folders_is_passed_over_never_followed(tmp_path, first_run):
    """A link at ``.fetched/rank-0`` of node b's new root had the restore delete everything
    in the folder it pointed to (the fetched folders are pruned after every restore); a
    folder ``v000000003`` (a name pcframe does not write) holding rank 2's real v3 manifest
    in node b's new root was taken for v3's shard there, so none was sent, and it then read
    as missing: v3 was skipped and its record set aside, though node a's memory held it.
    Both are passed over now: v3 comes from the peer copy."""
    root, _ = after_first_run(first_run, tmp_path)
    lose_node(root, "b")
    victim = tmp_path / "victim"
    for name in ("v00000001", "notes"):
        (victim / name).mkdir(parents=True)
        (victim / name / "keep.txt").write_text("not pcframe's\n")
    (root / "b" / ".fetched").mkdir(parents=True)
    (root / "b" / ".fetched" / "rank-0").symlink_to(victim)
    copy = next((root / "a-shm").glob("kept-by-rank-*/rank-2/v00000003"))
    stray = root / "b" / ".fetched" / "rank-2" / "v000000003"
    stray.mkdir(parents=True)
    shutil.copy(copy / "manifest.json", stray / "manifest.json")
    resumed = job(tmp_path, root, "resumed", 9)
    assert [r["restored_step"] for r in resumed] == [9] * 4
    assert resumed[0]["shard_sources"]["2"] == "peer memory"
    assert sorted(p.relative_to(victim).as_posix() for p in victim.rglob("*")) == [
        "notes", "notes/keep.txt", "v00000001", "v00000001/keep.txt"
    ]  # fmt: skip
    assert not list(root.glob("*/global/.corrupt-*"))


def test_a_damaged_shard_on_its_own_disk_is_fetched_again_from_a_peers_copy(
    tmp_path, reference, first_run
):
    """Rank 2's shard of v3 damaged on node b's own disk, node a's memory holding a good
    copy: v3 was skipped and its record set aside (the newest checkpoint lost although a
    copy of it was there). The damaged shard is now set aside, its files kept, and v3
    restores from the copy."""
    shutil.copytree(reference / "out", tmp_path / "out")
    root, _ = after_first_run(first_run, tmp_path)
    flip_byte(root / "b" / "rank-2" / "v00000003" / "data.bin", 100)
    resumed = job(tmp_path, root, "resumed", 12)
    assert [r["restored_step"] for r in resumed] == [9] * 4
    assert resumed[2]["shard_sources"]["2"] == "fetched"
    assert list((root / "b" / "rank-2").glob(".corrupt-v00000003-*"))  # kept for inspection
    assert not list(root.glob("*/global/.corrupt-*"))  # the version was not set aside
    assert_same_as_reference(tmp_path, "resumed", 9)


def test_a_damaged_shard_whose_copy_is_damaged_too_is_set_aside_not_passed_over(
    tmp_path, first_run
):
    """Both the shard on its disk and its peer's copy damaged: the shard was set aside to
    be fetched again, the copy then refused, and v3 counted as out of reach ("lost"), so
    it kept its place among the retained versions and the next save pruned v2, the one
    restored. It is corrupt: its record is set aside and v2 restores."""
    root, _ = after_first_run(first_run, tmp_path)
    flip_byte(root / "b" / "rank-2" / "v00000003" / "data.bin", 100)
    flip_byte(next((root / "a-shm").glob("kept-by-rank-*/rank-2/v00000003")) / "data.bin", 100)
    resumed = job(tmp_path, root, "resumed", 9)
    assert [r["restored_step"] for r in resumed] == [6] * 4
    assert all(not r["lost"] for r in resumed), resumed[0]["lost"]
    assert list((root / "b" / "global").glob(".corrupt-v00000003-*.json"))
    assert list((root / "b" / "rank-2").glob(".corrupt-v00000003-*"))  # kept for inspection


def test_a_damaged_peer_copy_is_dropped_and_the_version_before_it_is_taken(
    tmp_path, reference, first_run
):
    """No object store, one copy: the damaged copy of v3's rank-2 shard cannot be had from
    elsewhere, so v3 is passed over (not set aside: it is not damaged), and v2 loads."""
    shutil.copytree(reference / "out", tmp_path / "out")
    root, _ = after_first_run(first_run, tmp_path)  # v2's copy is there to fall back on
    lose_node(root, "b")
    copy = next((root / "a-shm").glob("kept-by-rank-*/rank-2/v00000003"))
    flip_byte(copy / "data.bin", 100)
    resumed = job(tmp_path, root, "resumed", 12)
    assert [r["restored_step"] for r in resumed] == [6] * 4
    assert resumed[0]["lost"] and resumed[0]["lost"][0][0] == 3
    assert not list((root / "a" / "global").glob(".corrupt-*"))  # nothing set aside
    assert_same_as_reference(tmp_path, "resumed", 6)


def test_a_damaged_copy_both_ranks_of_a_node_read_is_passed_over_never_set_aside(
    tmp_path, first_run
):
    """Node b is gone for good and the job goes on with node a's 2 ranks, both of which read
    rank 2's shard of v3 from the same copy in a's memory, one byte of it damaged. The copy
    is dropped only once both ranks have given their verdict: dropped by the first rank
    that found the damage, the other rank's read of it failed as "missing" in the root and
    v3 was set aside as corrupt, or as an I/O error that ended the restore."""
    root, _ = after_first_run(first_run, tmp_path)
    lose_node(root, "b")
    copy = next((root / "a-shm").glob("kept-by-rank-*/rank-2/v00000003"))
    flip_byte(copy / "data.bin", 100)
    runs = job(tmp_path, root, "two", 9, nodes={0: "a", 1: "a"})
    assert [r["restored_step"] for r in runs] == [6, 6], runs
    assert all(r["lost"] and r["lost"][0][0] == 3 for r in runs), runs
    assert not list((root / "a" / "global").glob(".corrupt-*"))  # nothing set aside
    assert 3 in rec.record_versions(root / "a")
    assert not copy.exists()  # the damaged copy itself is gone


def test_a_copy_whose_file_grew_is_fetched_again_from_the_node_it_reached_whole(
    tmp_path, reference, first_run
):
    """Node a's copy of rank 2's v3 has bytes appended: its read fails, but what node a sent
    the new node b was read by the manifest's ranges, so b's fetched copy is whole; the
    damaged copy is dropped and a's ranks take b's, and v3 is restored (it was set aside as
    corrupt, the job going back to v2)."""
    shutil.copytree(reference / "out", tmp_path / "out")
    root, _ = after_first_run(first_run, tmp_path)
    lose_node(root, "b")
    copy = next((root / "a-shm").glob("kept-by-rank-*/rank-2/v00000003"))
    with open(copy / "data.bin", "ab") as file:
        file.write(b"x" * 4096)
    resumed = job(tmp_path, root, "resumed", 12)
    assert [r["restored_step"] for r in resumed] == [9] * 4, resumed
    assert resumed[0]["shard_sources"]["2"] == "fetched"
    assert not list((root / "a" / "global").glob(".corrupt-*"))
    assert_same_as_reference(tmp_path, "resumed", 9)


def test_with_both_copies_lost_the_object_store_serves_each_byte_once(
    tmp_path, reference, moto_server, bucket
):
    """Node b is lost and node a's copies of b's shards too: b's shards come from the S3
    server, downloaded once (by one rank) and sent on to the other node that needs them."""
    shutil.copytree(reference / "out", tmp_path / "out")
    root = tmp_path / "ckpt"
    moto_server.client().create_bucket(Bucket=bucket)
    remote = ["--remote", f"s3://{bucket}/job", "--remote-endpoint", moto_server.endpoint]
    job(tmp_path, root, "first", 9, *remote)
    lose_node(root, "b")
    shutil.rmtree(root / "a-shm")  # the peer copies of b's shards are gone too
    resumed = job(tmp_path, root, "resumed", 12, *remote)
    assert [r["restored_step"] for r in resumed] == [9] * 4
    record = rec.read_record(rec.record_path(root / "a", 3))
    lost_bytes = sum(s.nbytes for s in record.shards if s.rank in (2, 3))
    assert sum(r["remote_bytes"] for r in resumed) == lost_bytes  # each byte read once
    assert_same_as_reference(tmp_path, "resumed", 9)


def test_with_every_disk_lost_the_job_numbers_above_what_the_object_store_holds(
    tmp_path, reference, moto_server, bucket
):
    """A job that closed cleanly, then both nodes lost (every root and memory folder new):
    the restore comes from the S3 server alone and brings back the job's last version, and
    the versions saved after it are numbered above every version there, though no rank's
    engine lists its own prefix when it opens (rank 0 lists the store once for the job, and
    the ranks agree on the number)."""
    shutil.copytree(reference / "out", tmp_path / "out")
    root = tmp_path / "ckpt"
    moto_server.client().create_bucket(Bucket=bucket)
    remote = ["--remote", f"s3://{bucket}/job", "--remote-endpoint", moto_server.endpoint]
    first = job(tmp_path, root, "first", 9, *remote)
    lose_node(root, "a")
    lose_node(root, "b")
    resumed = job(tmp_path, root, "resumed", 12, *remote)
    # The newest version: the first job closed cleanly, its last uploads done, and rank 0
    # uploaded that version's record at close (no round was left to decide it).
    assert [r["restored_step"] for r in resumed] == [9] * 4
    assert sum(r["remote_bytes"] for r in resumed) > 0
    newest_there = max(first[0]["versions"])  # every rank's shard of it is in the store
    for r in resumed:
        assert r["versions"] and min(r["versions"]) > newest_there
    assert_same_as_reference(tmp_path, "resumed", 9)


@pytest.mark.slow  # ~30 s: an S3 server stopped under a job of four ranks
def test_with_every_disk_lost_and_the_object_store_down_every_rank_says_so(
    tmp_path, own_moto_server, bucket
):
    """Both nodes lost and the S3 server down when the job restarts: every rank stops with
    one line saying a checkpoint may exist and the storage must be fixed (before: rank 0
    died of botocore's raw connection error, the other rank blamed a rank that left, and a
    store that did not answer was never bounded by the tier's deadline)."""
    root = tmp_path / "ckpt"
    own_moto_server.client().create_bucket(Bucket=bucket)
    remote = ["--remote", f"s3://{bucket}/job", "--remote-endpoint", own_moto_server.endpoint]
    two_nodes = {0: "a", 1: "b"}
    job(tmp_path, root, "first", 6, *remote, nodes=two_nodes)
    lose_node(root, "a")
    lose_node(root, "b")
    own_moto_server.kill()
    args = ["nodes", "--root", str(root), "--out", str(tmp_path / "out"), "--tag", "resumed"]
    env = {rank: {"PCFRAME_NODE": node} for rank, node in two_nodes.items()}
    result = run_job(
        2, [*args, *remote], tmp_path / "logs-resumed", rank_env=env, kill_on_failure=False
    )
    assert all(rc != 0 for rc in result.returncodes), result.returncodes
    for log in result.logs:
        assert "RestoreIOError: restore: cannot tell whether a checkpoint exists" in log, log
        assert "botocore.exceptions." not in log  # no raw error of the client's
