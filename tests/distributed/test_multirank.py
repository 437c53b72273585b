"""Real multi-rank jobs on CPU (gloo): round trip, resize, SIGKILL during a save, resume.

Every job is 2 or 3 separate Python processes with a real process group; crashes are real
SIGKILLs at the engine's and the protocol's crash points (:mod:`pcframe.runtime.faults`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pcframe.apps import cli as pcframe_cli
from pcframe.distributed import global_versions as rec
from pcframe.format.manifest import MANIFEST_NAME, read_manifest
from pcframe.format.names import version_name
from pcframe.restore.reader import load_version
from pcframe.store.directory import CheckpointDir, WritableCheckpointDir
from tests.distributed.launch import REPO, base_env, run_job
from tests.helpers import flip_byte

pytestmark = pytest.mark.slow


def results(out: Path, scenario: str, tag: str, world: int) -> list[dict]:
    return [json.loads((out / f"{scenario}-{tag}-r{r}.json").read_text()) for r in range(world)]


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys=None) -> None:
    keys = sorted(a) if keys is None else keys
    assert set(keys) <= set(b), sorted(set(keys) - set(b))
    different = [k for k in keys if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, f"not bit-identical: {different}"


def check_global_versions(root: Path) -> tuple[int | None, list[int]]:
    """Every global record on disk names shards that exist, match it, and verify in full."""
    records, invalid = rec.valid_records(root)
    assert not invalid, invalid
    for record in records:
        for shard in record.shards:
            directory = root / shard.directory / version_name(shard.version)
            assert rec.manifest_crc(directory / MANIFEST_NAME) == shard.manifest_crc32c
            load_version(directory)  # raises unless every chunk checksum matches
    pointer = rec.read_pointer(root)
    versions = sorted(r.version for r in records)
    assert pointer is None or pointer in versions, "GLOBAL names a version without a record"
    return pointer, versions


def crashed_after_third_record(root: Path) -> int:
    """What a coordinator killed right after writing its third global record leaves behind.

    That record is durable and the newest, though GLOBAL still names the one before it (the
    pointer is written after the record). Its version is 3 (step 9), or 4 (step 12) when a
    rank's step-12 save committed before its step-9 one: with two saves in flight the older
    is then discarded, its round publishes nothing, and the third record is version 4. That
    is timing, not a bug, so the caller gets the record's step instead of a fixed number.
    """
    pointer, versions = check_global_versions(root)
    assert len(versions) == 3, versions  # killed before retention could drop the first
    assert pointer == versions[-2], (pointer, versions)
    newest = rec.valid_records(root)[0][0]
    assert newest.version == versions[-1] and newest.step in (9, 12), newest
    return newest.step


# --- save / restore round trip (2 ranks) and a restore with 3 ranks ------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("saved")
    root, out = base / "ckpt", base / "out"
    out.mkdir()
    # A live process (this one) writes rank 1's directory of the "locked" checkpoint.
    locked = WritableCheckpointDir(root / "locked" / "rank-1")
    try:
        job = run_job(2, ["roundtrip", "--root", str(root), "--out", str(out)], base / "logs")
    finally:
        locked.close()
    job.check()
    return root, out


def test_round_trip_restores_exactly_the_saved_state_on_every_rank(saved):
    _, out = saved
    for result in results(out, "roundtrip", "run", 2):
        for kind in ("ddp", "fsdp"):
            assert result[kind]["published"], kind
            assert result[kind]["moved_on"], kind  # training changed the state after the save
            assert result[kind]["restored_step"] == 6, kind
            assert result[kind]["version"] == 2, kind
            assert result[kind]["restored_equal"], f"{kind}: restored state differs"
            # The live tensors keep their memory; DDP's plain ones are read straight into it
            # (model and optimizer state: every byte), FSDP's DTensors are copied by the apply
            assert result[kind]["same_memory"], kind
        assert result["ddp"]["in_place_bytes"] == result["ddp"]["live_bytes"]
        assert result["fsdp"]["in_place_bytes"] == 0
        assert result["hooked_restored"]  # its state_dict gives copies: loaded, not filled
        assert result["hooked_in_place_model_bytes"] == 0
        assert result["padded_published"]
        assert result["padded_restored"]
        assert result["collector_paused_in_restore"]
        # Open, the checkpointer holds its gloo groups; closed, none (nor any work).
        assert "ProcessGroup" in result["gloo_held_open"], result["gloo_held_open"]
        assert result["gloo_held_closed"] == [], result["gloo_held_closed"]


def test_a_damaged_shard_makes_every_rank_fall_back_to_the_previous_global_version(saved):
    _, out = saved
    for result in results(out, "roundtrip", "run", 2):
        damaged = result["damaged"]
        assert damaged["restored_step"] == 3
        assert damaged["equal_to_first_save"]
        assert damaged["in_place_bytes"] > 0  # v1 filled the live tensors ...
        assert damaged["data_files_left_open"] == []  # ... and its files were let go
        (version, reason), *_ = damaged["skipped"]
        assert version == 2 and "rank 1" in reason and "checksum mismatch" in reason


def test_a_rank_that_cannot_open_its_shard_fails_every_rank_at_once(saved):
    _, out = saved
    rank0, rank1 = (r["locked"] for r in results(out, "roundtrip", "run", 2))
    assert rank1.startswith("DirectoryLocked") and f"pid {os.getpid()}" in rank1
    assert rank0.startswith("CheckpointError: rank 1 could not open its checkpoint shard")


def test_a_save_that_fails_on_one_rank_is_not_global_and_the_next_one_is(saved):
    _, out = saved
    rank0, rank1 = (r["failure"] for r in results(out, "roundtrip", "run", 2))
    assert [o[:2] for o in rank0["outcomes"]] == [[1, True], [2, False], [3, True]]
    assert "rank 1 failed" in rank0["outcomes"][1][2]
    assert "injected failure" in rank0["outcomes"][1][2]
    assert [o[:2] for o in rank1["outcomes"]] == [[1, True], [None, False], [3, True]]
    assert rank0["globals"] == rank1["globals"] == [1, 3]


def test_replicated_state_is_written_once_and_shards_by_their_owners(saved):
    root, out = saved
    full = tensors(out / "ddp-saved-r0.safetensors")
    state_keys = {k for k in full if k.startswith(("model/", "optimizer/"))}
    for kind in ("ddp", "fsdp"):
        written: dict[str, list[tuple[int, tuple, tuple]]] = {}
        for rank in range(2):
            manifest = read_manifest(str(root / kind / f"rank-{rank}/v00000002" / MANIFEST_NAME))
            tree = manifest.tree
            for key, node in tree["model"].items():
                if node["kind"] != "value":
                    written.setdefault(f"model/{key}", []).append((rank, node))
            for index, entries in tree["optimizer"]["state"].items():
                for key, node in entries.items():
                    if node["kind"] != "value":
                        written.setdefault(f"optimizer/{index}/{key}", []).append((rank, node))
        if kind == "ddp":
            assert set(written) == state_keys
            assert all(len(w) == 1 for w in written.values()), "a replicated tensor written twice"
            assert {w[0][0] for w in written.values()} == {0, 1}, "one rank wrote everything"
        else:
            for name, writers in written.items():
                kinds = {node["kind"] for _, node in writers}
                if kinds == {"shard"}:  # FSDP2: every rank writes its own box
                    offsets = sorted(tuple(node["offset"]) for _, node in writers)
                    assert len(writers) == 2 and offsets[0] != offsets[1], name
                else:  # e.g. Adam's step counter: plain tensors, written once
                    assert kinds == {"replicated"} and len(writers) == 1, name
    sizes = [os.path.getsize(root / "ddp" / f"rank-{r}/v00000002/data.bin") for r in (0, 1)]
    assert max(sizes) < 1.5 * min(sizes), f"replicated bytes not spread: {sizes}"


def test_global_record_pins_every_ranks_shard(saved):
    root, _ = saved
    for kind in ("ddp", "fsdp", "padded"):
        pointer, versions = check_global_versions(root / kind)
        assert pointer == versions[-1]
    record = rec.read_record(rec.record_path(root / "ddp", 2))
    assert record.world_size == 2 and record.step == 6
    assert [s.directory for s in record.shards] == ["rank-0", "rank-1"]


def test_restore_with_more_ranks_reshards_or_refuses_clearly(saved):
    root, out = saved
    job = run_job(3, ["resize", "--root", str(root), "--out", str(out)], out.parent / "logs3")
    job.check()
    reports = results(out, "resize", "run", 3)
    for kind in ("ddp", "fsdp"):
        expected = tensors(out / f"{kind}-saved-r0.safetensors")
        keys = [k for k in expected if k.startswith(("model/", "optimizer/", "scheduler/"))]
        for rank in range(3):
            report = reports[rank][kind]
            assert report["restored_step"] == 6
            assert report["saved_world_size"] == 2
            assert report["resharded"] == (kind == "fsdp")
            assert report["saved_after_resize"], "a resized job could not save"
            got = tensors(out / f"{kind}-resized-r{rank}.safetensors")
            assert_same(expected, got, keys)
            if rank < 2:  # per-rank state comes from the same rank of the old job
                assert report["per_rank_state_from"] == rank
                assert_same(tensors(out / f"{kind}-saved-r{rank}.safetensors"), got, ["rng"])
            else:
                assert report["per_rank_state_from"] is None
        refused = reports[0]["fsdp"]["refused"]
        assert "saved by 2 ranks" in refused and "this job has 3 ranks" in refused
        error = reports[0]["padded_error"]
        assert "cannot reshard" in error and "model/table" in error
        assert "(saved by 2 ranks)" in error and "(3 ranks)" in error
    assert rec.read_record(rec.record_path(root / "ddp", 3)).world_size == 3


# --- SIGKILL during a save, restart, bit-identical resume --------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """An uninterrupted run: 12 steps, a save every 3, saves overlapping training."""
    base = tmp_path_factory.mktemp("reference")
    root, out = base / "ckpt", base / "out"
    out.mkdir()
    args = ["train", "--root", str(root), "--out", str(out), "--tag", "ref"]
    run_job(2, args, base / "logs").check()
    return root, out


def test_retention_keeps_the_current_and_previous_global_versions(reference):
    root, out = reference
    pointer, versions = check_global_versions(root)
    assert pointer == 4 and versions == [3, 4]
    for rank in range(2):
        local = CheckpointDir(root / f"rank-{rank}").committed_versions()
        # keep_last=1 locally, yet the previous global version's shard was kept; older ones
        # (including version 1, superseded while rounds lagged behind commits) are gone.
        assert local == [3, 4], local
    assert results(out, "train", "ref", 2)[0]["globals"] == [3, 4]


def test_sigkill_of_a_rank_mid_save_keeps_previous_global_and_torchrun_restart_resumes(
    reference, tmp_path
):
    _, ref_out = reference
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    env = base_env()
    # Rank 1 dies (SIGKILL) in the save of version 3, after its data is synced but before
    # its local commit; torchrun then kills rank 0 and restarts the whole job once.
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: torch issue #135712, without it gloo groups of the
    # restarted job read stale addresses from the previous attempt.
    env.update(
        TEST_CRASH_AT="data_synced:3", TEST_CRASH_RANK="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=1", "--module", "tests.distributed.worker", "train",
        "--root", str(root), "--out", str(out), "--tag", "torchrun", "--sync",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    first = results(out, "train", "torchrun", 2)[0]
    # What the restarted job found: version 2 global, nothing of version 3.
    assert first["pointer_at_start"] == 2 and first["records_at_start"] == [1, 2]
    assert first["restored_step"] == 6
    # Version 3's number is burnt if rank 0 committed its shard before torchrun killed it
    # (the usual case), free if rank 0 was still writing it (a busy machine): the restart
    # numbers one above whatever it found, never below.
    burnt = first["next_at_start"]
    assert burnt in (3, 4)
    assert [v for v, ok in first["published"]] == [burnt, burnt + 1]
    assert all(ok for _, ok in first["published"])
    check_global_versions(root)
    for rank in range(2):
        assert_same(
            tensors(ref_out / f"train-ref-r{rank}.safetensors"),
            tensors(out / f"train-torchrun-r{rank}.safetensors"),
        )


def test_coordinator_killed_after_writing_the_record_then_restart_resumes(reference, tmp_path):
    _, ref_out = reference
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    args = ["train", "--root", str(root), "--out", str(out), "--tag", "crash"]
    crashed = run_job(
        2, args, tmp_path / "logs1", rank_env={0: {"PCFRAME_CRASH_AT": "global_record_written:3"}}
    )
    assert crashed.returncodes[0] == -9, crashed.logs[0][-3000:]
    # The third record is durable (every shard was reported durable before it was written):
    # the restart resumes from it, not from the older version GLOBAL still names.
    newest_step = crashed_after_third_record(root)
    resumed_args = ["train", "--root", str(root), "--out", str(out), "--tag", "resumed"]
    run_job(2, resumed_args, tmp_path / "logs2").check()
    resumed = results(out, "train", "resumed", 2)[0]
    assert resumed["restored_step"] == newest_step
    for rank in range(2):
        assert_same(
            tensors(ref_out / f"train-ref-r{rank}.safetensors"),
            tensors(out / f"train-resumed-r{rank}.safetensors"),
        )
    pointer, versions = check_global_versions(root)
    assert rec.valid_records(root)[0][0].step == 12  # the newest global state is the last step
    if newest_step == 9:
        # The resumed job saved step 12 and published it. Its number is 4, or 5 when rank 1
        # had already committed a local v4 before rank 0 died (numbers are never reused).
        assert pointer == versions[-1] and versions[-1] in (4, 5)


def test_delta_shards_survive_a_coordinator_crash_and_resume_bit_identically(reference, tmp_path):
    """XOR-delta shard versions: retention keeps their bases, a restart restores exactly."""
    _, ref_out = reference
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    args = ["train", "--root", str(root), "--out", str(out), "--deltas"]
    crashed = run_job(
        2,
        [*args, "--tag", "dcrash"],
        tmp_path / "logs1",
        rank_env={0: {"PCFRAME_CRASH_AT": "global_record_written:3"}},
    )
    assert crashed.returncodes[0] == -9, crashed.logs[0][-3000:]
    newest_step = crashed_after_third_record(root)  # its shards and their bases verify
    run_job(2, [*args, "--tag", "dresumed"], tmp_path / "logs2").check()
    assert results(out, "train", "dresumed", 2)[0]["restored_step"] == newest_step
    for rank in range(2):  # lossless deltas: the same state as the reference without them
        assert_same(
            tensors(ref_out / f"train-ref-r{rank}.safetensors"),
            tensors(out / f"train-dresumed-r{rank}.safetensors"),
        )
    check_global_versions(root)
    deltas = []
    for rank in range(2):
        shards = CheckpointDir(root / f"rank-{rank}")
        for version in shards.committed_versions():
            manifest = read_manifest(str(shards.path(version) / MANIFEST_NAME))
            if manifest.delta is not None:
                deltas.append((rank, version))
                assert manifest.delta.base in shards.committed_versions()
    assert deltas, "no delta version was written"


def test_a_corrupt_global_version_stops_counting_so_the_good_one_before_it_survives(tmp_path):
    """After falling back from a corrupt v4 to v3, the next publication keeps v3, not v4.

    Before, the restore only skipped v4: it still counted as one of the two retained global
    versions, so publishing v5 deleted v3's record, and one more fault (v5 damaged) left
    nothing to restore although v3's shards were still on disk.
    """
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    args = ["train", "--root", str(root), "--out", str(out)]
    run_job(2, [*args, "--tag", "first"], tmp_path / "logs1").check()  # v1..v4, keeps v3 v4
    assert rec.record_versions(root) == [3, 4]
    flip_byte(root / "rank-1" / "v00000004" / "data.bin", 100)
    run_job(2, [*args, "--tag", "second"], tmp_path / "logs2").check()  # v3, then v5 at 12
    assert results(out, "train", "second", 2)[0]["restored_step"] == 9
    assert rec.record_versions(root) == [3, 5]
    # The bad version's record is kept aside, not deleted, and verify names it and why.
    assert len(list((root / "global").glob(".corrupt-v00000004-*.json"))) == 1
    verify = io.StringIO()
    with contextlib.redirect_stdout(verify):
        assert pcframe_cli.main(["verify", str(root)]) == 1  # the damage is still there
    set_aside = [line for line in verify.getvalue().splitlines() if "set aside" in line]
    assert len(set_aside) == 1 and "v00000004" in set_aside[0], verify.getvalue()
    assert "rank 1" in set_aside[0] and "checksum mismatch" in set_aside[0], set_aside
    flip_byte(root / "rank-0" / "v00000005" / "data.bin", 100)
    run_job(2, [*args, "--tag", "third", "--steps", "9"], tmp_path / "logs3").check()
    assert results(out, "train", "third", 2)[0]["restored_step"] == 9
    assert check_global_versions(root)[1] == [3]  # v5 set aside too; v3 verifies in full
    # When nothing verifies (here v3 damaged too; a root not mounted on a node looks the
    # same), nothing is set aside: the record is still there for a restore that can read it.
    flip_byte(root / "rank-0" / "v00000003" / "data.bin", 100)
    failed = run_job(2, [*args, "--tag", "fourth", "--steps", "9"], tmp_path / "logs4")
    assert failed.returncodes[0] != 0 and "NoValidCheckpoint" in failed.logs[0]
    assert rec.record_versions(root) == [3]


def _set_header(path: Path, **fields) -> None:
    """Change a manifest's or record's header line (outside the body's checksum)."""
    header, body = path.read_bytes().split(b"\n", 1)
    path.write_bytes(json.dumps(json.loads(header) | fields).encode() + b"\n" + body)


def _tree(root: Path) -> list[str]:
    # What a start takes or leaves whatever happens next (its locks, the clean-exit marks).
    def kept(p: Path) -> bool:
        return not p.name.endswith(".lock") and p.name != ".clean-exit"

    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if kept(p))


def test_a_newer_writers_global_version_stops_the_restore_and_moves_nothing(tmp_path):
    """A shard of a newer format (or codec) on one rank, or a record of a newer format, is
    no corruption: every rank stops with one error, and no record or shard is set aside.

    Before, the shard read as corrupt: v4's record was moved aside, v3 restored, and the
    next publication pruned v4's shards, so the newer work was gone.
    """
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    args = ["train", "--root", str(root), "--out", str(out)]
    run_job(2, [*args, "--tag", "first"], tmp_path / "logs1").check()  # keeps v3 v4
    _set_header(root / "rank-1" / "v00000004" / MANIFEST_NAME, format_version=99)
    before = _tree(root)
    job = run_job(2, [*args, "--tag", "second"], tmp_path / "logs2", kill_on_failure=False)
    for rank in (0, 1):
        assert job.returncodes[rank] != 0, job.logs[rank][-3000:]
        assert "UnsupportedCheckpoint: global version 4 cannot be read" in job.logs[rank]
        assert "rank 1: " in job.logs[rank] and "format_version 99" in job.logs[rank]
    assert _tree(root) == before
    # A global record of a newer format stops it the same way.
    _set_header(root / "rank-1" / "v00000004" / MANIFEST_NAME, format_version=1)
    _set_header(rec.record_path(root, 4), format_version=2)
    job = run_job(2, [*args, "--tag", "third"], tmp_path / "logs3", kill_on_failure=False)
    for rank in (0, 1):
        assert "UnsupportedCheckpoint: the newest global record cannot be read" in job.logs[rank]
    assert _tree(root) == before


def test_an_exception_on_one_rank_ends_the_job_instead_of_hanging_it(tmp_path):
    """Leaving the ``with`` block on an exception takes part in no collective.

    Before, rank 1 waited in close()'s barrier for rank 0, which waited in DDP's all-reduce
    for rank 1: the job hung for ``protocol_timeout`` (30 min) where, without pcframe, gloo
    ends it at once. Now rank 1 exits with its own error and rank 0 fails in its all-reduce.
    """
    out = tmp_path / "out"
    out.mkdir()
    args = ["raises", "--root", str(tmp_path / "ckpt"), "--out", str(out)]
    job = run_job(2, args, tmp_path / "logs", timeout=90)
    assert job.returncodes[1] == 1, (job.returncodes, job.logs[1][-3000:])
    assert "RuntimeError: a bug in rank 1's training step" in job.logs[1], job.logs[1][-3000:]
    assert job.returncodes[0] != 0  # rank 0 was killed or failed, not left waiting


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ("grows", "RanksOutOfStep: ranks disagree on the structure of the model/optimizer "
                  "state at version 3 (state digests rank 0: "),
        ("skips", "RanksOutOfStep: the ranks are out of step: rank 0 in save() of version 3 "
                  "at step 3; rank 1 in save() of version 3 at step 4;"),
        ("fewer", "RanksOutOfStep: the ranks are out of step: rank 0 in save() of version 3 "
                  "at step 3; rank 1 in close() before saving version 3;"),
    ],
)  # fmt: skip
def test_a_rank_out_of_step_is_one_clear_error_on_every_rank_at_once(tmp_path, variant, expected):
    """One rank's state grows, it skips a save, or it closes while the others save.

    Before, rank 1 alone entered the structure agreement (``grows``), or the ranks' round
    threads waited for a version the other never started: every rank hung for
    ``protocol_timeout`` (30 min), then read that a peer had left. Now both ranks raise at
    the meeting that begins the call (rank 0 when its handle's ``wait()`` reads it), naming
    what each was doing; v2 stays the newest.
    """
    out = tmp_path / "out"
    out.mkdir()
    root = tmp_path / "ckpt"
    args = ["astray", "--root", str(root), "--out", str(out), "--tag", variant]
    job = run_job(2, args, tmp_path / "logs", timeout=100, kill_on_failure=False)
    for rank in (0, 1):
        assert job.returncodes[rank] == 1, (job.returncodes, job.logs[rank][-3000:])
        error = json.loads((out / f"astray-{variant}-r{rank}.json").read_text())["error"]
        assert error.startswith(expected), error
        assert "\n" not in error
    pointer, versions = check_global_versions(root)
    assert pointer == 2 and versions == [1, 2], (pointer, versions)


def test_a_save_that_fails_before_reading_the_state_loses_one_version_not_the_job(tmp_path):
    """Rank 1's ``state_dict()`` raises: it meets the others anyway, so save 4 is global."""
    out = tmp_path / "out"
    out.mkdir()
    root = tmp_path / "ckpt"
    args = ["astray", "--root", str(root), "--out", str(out), "--tag", "fails"]
    run_job(2, args, tmp_path / "logs", timeout=100).check()
    seen = [json.loads((out / f"astray-fails-r{r}.json").read_text()) for r in (0, 1)]
    assert [o[1] for o in seen[0]["outcomes"]] == ["global", "global", "SaveError", "global"]
    assert [o[1] for o in seen[1]["outcomes"]] == ["global", "global", "RuntimeError", "global"]
    pointer, versions = check_global_versions(root)
    assert pointer == 4 and versions == [2, 4], (pointer, versions)


@pytest.mark.parametrize(("found_in", "raised_at"), [("decide", 5), ("save", 6)])
def test_an_earlier_failure_on_one_rank_is_raised_after_the_meeting_not_before(
    tmp_path, found_in, raised_at
):
    """Rank 1's disk fills as it commits versions 2 and 6 while rank 0's round lags behind.

    Before (found by a review of the meetings), rank 1's maybe_save() raised v2's failure
    before its meeting and restore() raised v6's before its own: rank 0 waited in the
    meeting, rank 1 in DDP's all-reduce, until protocol_timeout, and then every call said a
    rank had left. Now both ranks meet, the failure is raised after (or logged, in a
    restore that rolls back anyway), and training and saving go on.

    The worker orders it without sleeps (it used to slow rank 0's commits by 1 s and hope):
    rank 1's engine finds v2's failure in maybe_save's decide() (``decide``) or, v2 failing
    just after that, in its save() (``save``), and no round thread can have taken it first.
    Each failure reaches the user exactly once: v2 raised by that maybe_save, v6 logged by
    the restore. (Before, a failure the engine found in save() was dropped: the round thread
    leaves a failure the engine raised to it, and save() started the next version over it.)
    v5 is waited for before v6 starts: with both in flight, v6 landing first on a rank
    discarded v5 there, and the restore went back to step 8.
    """
    out = tmp_path / "out"
    out.mkdir()
    root = tmp_path / "ckpt"
    args = ["late_failure", "--root", str(root), "--out", str(out), "--tag", found_in]
    job = run_job(2, args, tmp_path / "logs", timeout=100)
    job.check()
    seen = [json.loads((out / f"late_failure-{found_in}-r{r}.json").read_text()) for r in (0, 1)]
    errors = [[o for o in seen[r]["outcomes"] if o[1] not in (None, 1, 2, 3, 4)] for r in (0, 1)]
    assert errors == [[], [[raised_at, "SaveError v2"]]], seen
    assert seen[1]["outcomes"][-1] == ["wait", None], seen[1]  # raised once, not again
    assert job.logs[1].count("before the restore: ") == 1, job.logs[1][-3000:]
    assert "version 6" in job.logs[1].split("before the restore: ")[1].splitlines()[0]
    assert "before the restore: " not in job.logs[0], job.logs[0][-3000:]
    for rank in (0, 1):
        assert seen[rank]["restored"] == 9 and seen[rank]["after"] == "committed", seen[rank]


PLACEMENT_FAILED = (
    "placement policy 'rank_one_fails' (__main__.RankOneFails).place raised "
    "RuntimeError: no tier for version 2 on this rank for version 2; "
)
INTERVAL_FAILED = (
    "policy __main__.RankOneAnswersNone.decide returned None; it must return "
    "pcframe.policies.Decision(save=..., reason=...)"
)
TOLD = "failed on rank 1, so every rank raises this at that call and the ranks stay in step "
TOLD += "(the last global version is intact): rank 1: "


@pytest.mark.parametrize(
    ("call", "failed_at", "said"),
    [
        ("maybe_save", "maybe_save() of version 3 at step 3", PLACEMENT_FAILED),
        ("close", "close() before saving version 3", PLACEMENT_FAILED),
        ("interval", "maybe_save() of version 3 at step 3", INTERVAL_FAILED),
    ],
)
def test_a_policy_that_fails_on_one_rank_is_raised_on_every_rank_at_its_meeting(
    tmp_path, call, failed_at, said
):
    """Rank 1's placement policy raises for version 2 (on the commit thread), and its engine
    raises the PolicyError at the next call, maybe_save(3) or close(); or rank 1's interval
    policy answers None at maybe_save(3).

    Before, rank 1 raised it before that call's meeting: rank 0 waited in the meeting for
    protocol_timeout (90 s here, 30 min by default) and then read that no rank answered
    (maybe_save), or waited in close()'s meeting until rank 1's process exited. Now rank 1
    meets the others, marked failed, and both ranks raise at that call one PolicyError line
    naming rank 1 and the policy; after maybe_save(3) the ranks are still in step, and
    version 3 (step 4) is global.
    """
    out = tmp_path / "out"
    out.mkdir()
    root = tmp_path / "job"
    args = ["placement_fails", "--root", str(root), "--out", str(out), "--tag", call]
    job = run_job(2, args, tmp_path / "logs", timeout=150, kill_on_failure=False)
    job.check()
    seen = [json.loads((out / f"placement_fails-{call}-r{r}.json").read_text()) for r in (0, 1)]
    for rank in (0, 1):
        outcomes = dict((str(k), v) for k, v in seen[rank]["outcomes"])
        raised = outcomes.pop("close" if call == "close" else "3")
        assert raised.startswith(f"PolicyError: {failed_at} {TOLD}{said}"), (rank, raised)
        assert "\n" not in raised
        if call == "close":
            assert outcomes == {"1": "global", "2": "global"}, (rank, outcomes)
        else:
            expected = {"1": "global", "2": "global", "4": "global", "close": "closed"}
            assert outcomes == expected, (rank, outcomes)
    pointer, versions = check_global_versions(root / "ckpt")
    assert pointer == (2 if call == "close" else 3), (pointer, versions)


def test_a_placement_failure_found_by_one_ranks_save_fails_that_version_on_every_rank(
    tmp_path,
):
    """Rank 1's placement failure (version 2) found by its save(3), after that save's
    meeting: no rank waits (a guard; this path did not hang before either). Rank 1's
    save(3) raises the PolicyError, rank 0's wait() of version 3 a SaveError naming rank 1
    and the policy; version 3 is lost (rank 1 never started it), version 4 is global."""
    out = tmp_path / "out"
    out.mkdir()
    root = tmp_path / "job"
    args = ["placement_fails", "--root", str(root), "--out", str(out), "--tag", "save"]
    run_job(2, args, tmp_path / "logs", timeout=150, kill_on_failure=False).check()
    seen = [json.loads((out / f"placement_fails-save-r{r}.json").read_text()) for r in (0, 1)]
    raised = [dict((str(k), v) for k, v in seen[r]["outcomes"]).pop("3") for r in (0, 1)]
    assert raised[0].startswith("SaveError: checkpoint version 3 (step 3) failed in stage "), raised
    assert f"rank 1 failed: save() raised PolicyError: {PLACEMENT_FAILED}" in raised[0], raised
    assert raised[1].startswith(f"PolicyError: {PLACEMENT_FAILED}"), raised
    for rank in (0, 1):
        assert [o[1] for o in seen[rank]["outcomes"] if o[0] != 3] == ["global"] * 3 + ["closed"]
    pointer, versions = check_global_versions(root / "ckpt")
    assert pointer == 4, (pointer, versions)


def test_a_rank_that_stops_answering_is_named_as_such_after_the_timeout(tmp_path):
    """Rank 1 is alive but not at the save: rank 0 is told so, not that a rank left."""
    out = tmp_path / "out"
    out.mkdir()
    args = ["astray", "--root", str(tmp_path / "ckpt"), "--out", str(out), "--tag", "stalls"]
    job = run_job(2, args, tmp_path / "logs", timeout=100, kill_on_failure=False)
    assert job.returncodes == [1, 1], (job.returncodes, job.logs[0][-3000:])
    error = json.loads((out / "astray-stalls-r0.json").read_text())["error"]
    assert error.startswith("CheckpointError: save: no answer from every rank within "), error
    assert "not making this call" in error and "\n" not in error


def test_a_rank_gone_before_restore_is_one_clear_error_on_the_others(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    args = ["leaves", "--root", str(tmp_path / "ckpt"), "--out", str(out)]
    job = run_job(2, args, tmp_path / "logs", timeout=90, kill_on_failure=False)
    assert job.returncodes == [1, 3], (job.returncodes, job.logs[0][-3000:])
    error = json.loads((out / "leaves-run-r0.json").read_text())["error"]
    assert error.startswith("restore: another rank left the job or stopped answering (")
    assert "restart every rank" in error and "\n" not in error


# --- maybe_save: one decision for the whole job ---------------------------------------------------


def test_maybe_save_follows_rank_0_and_any_ranks_emergency(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    args = ["policy", "--root", str(tmp_path / "ckpt"), "--out", str(out), "--steps", "12"]
    run_job(2, args, tmp_path / "logs").check()
    first, second = results(out, "policy", "run", 2)
    # Rank 0 saves every 3 steps, rank 1's own schedule (every 5) is ignored, and rank 1's
    # emergency at step 7 is a save on both ranks, global before maybe_save returned.
    assert first["saved_steps"] == second["saved_steps"] == [3, 6, 7, 9, 12]
    assert first["emergency_global_on_return"] and second["emergency_global_on_return"]
    assert first["global_steps"] == second["global_steps"] == [9, 12]  # keep_global=2
    # A restart restores each rank's policy state, tells the policy what the restored
    # version's save cost (its state was taken before it knew), then about the restart.
    for result in (first, second):
        assert result["restored_step"] == 12
        seen = result["restored_policy_seen"]
        assert seen[-3:] == ["loaded", "SaveCompleted", "Restarted"]
        assert "SaveCompleted" in seen[:-3]  # learnt before the version, kept in its state


def test_cli_lists_and_verifies_a_multi_rank_root(saved, tmp_path, capsys):
    import shutil

    from pcframe.apps.cli import main

    root = tmp_path / "ddp"
    shutil.copytree(saved[0] / "ddp", root)
    pointer, versions = check_global_versions(root)
    assert main(["list", str(root)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:]]
    worlds = {r.version: r.world_size for r in rec.valid_records(root)[0]}
    assert [(int(r[0]), int(r[2])) for r in rows] == [(v, worlds[v]) for v in versions]
    assert "<- GLOBAL" in out.splitlines()[-1]
    assert main(["verify", str(root)]) == 0
    assert capsys.readouterr().out.count(" ranks, ") == len(versions)
    # One flipped byte in rank 1's shard of the newest version fails that version, naming
    # the rank; the older versions still verify.
    data = root / "rank-1" / version_name(pointer) / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["verify", str(root)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith(f"v{pointer}: FAILED: rank 1: ") and "checksum" in lines[-1]
    assert all("OK" in line for line in lines[:-1])
    # inspect and export read one rank's shard: the error says which directory to give.
    assert main(["inspect", str(root)]) == 2
    assert f"pcframe inspect {root / 'rank-0'}" in capsys.readouterr().err


def test_non_tensor_entries_holding_tensors_restore_each_ranks_own_value(tmp_path):
    """A tensor inside get_extra_state() or a list of tensors in an optimizer's state: both
    saves committed, then the restore read the value without its tensors, called the
    newest version corrupt and fell back to v1 (or NoValidCheckpoint). And every rank got
    rank 0's value, though each rank wrote its own."""
    out = tmp_path / "out"
    out.mkdir()
    args = ["values", "--root", str(tmp_path / "ckpt"), "--out", str(out)]
    run_job(2, args, tmp_path / "logs").check()
    for rank, result in enumerate(results(out, "values", "run", 2)):
        assert result["saved"] == "committed"
        assert result["restored"] == 2 and result["skipped"] == []
        assert result["scale"] == [0.5, 2.0 + rank] and result["seen"] == 100 + rank
        assert result["hist"] == [[1.0, 1.0], [float(rank)] * 2]
