"""pcframe.load() restores from a read-only checkpoint directory and writes nothing."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest
import torch

import pcframe
from pcframe import Checkpointer, NoValidCheckpoint
from tests.helpers import small_training, state_equal, train_steps


def snapshot_tree(root) -> dict:
    return {p: (p.stat().st_mode, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def make_read_only(root) -> None:
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
        os.chmod(path, mode)


def test_load_from_a_read_only_directory(tmp_path):
    model, optimizer, scheduler = small_training()
    with Checkpointer(tmp_path / "ro", model=model, optimizer=optimizer, scheduler=scheduler) as c:
        for step in (1, 2):
            train_steps(model, optimizer, scheduler, 1, seed=step)
            c.save(step).wait()
            if step == 1:
                after_step_1 = {k: v.clone() for k, v in model.state_dict().items()}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    root = tmp_path / "ro"
    # Corrupt the newest version: load falls back, but renames nothing (it cannot write).
    data = root / "v00000002" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(raw)
    make_read_only(root)
    before = snapshot_tree(root)
    model2, optimizer2, scheduler2 = small_training(seed=5)
    report = pcframe.load(root, model=model2, optimizer=optimizer2, scheduler=scheduler2)
    assert report.step == 1 and report.skipped and report.skipped[0][0] == 2
    assert snapshot_tree(root) == before  # nothing created, renamed, locked or changed
    assert state_equal(model2.state_dict(), after_step_1)  # version 1, not the corrupt 2
    assert not state_equal(model2.state_dict(), expected)
    os.chmod(root, 0o755)


def test_load_reports_no_checkpoint_and_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    assert pcframe.load(tmp_path / "empty", model=torch.nn.Linear(2, 2)).step is None
    with pytest.raises(pcframe.CheckpointError, match="not a directory"):
        pcframe.load(tmp_path / "missing", model=torch.nn.Linear(2, 2))
    with Checkpointer(tmp_path / "one", model=torch.nn.Linear(2, 2)) as c:
        c.save(1).wait()
    (tmp_path / "one" / "v00000001" / "manifest.json").write_text("garbage")
    with pytest.raises(NoValidCheckpoint):
        pcframe.load(tmp_path / "one", model=torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ({"allow_cast": "no"}, r"load\(allow_cast='no'\): give True or False"),
        ({"strict": "False"}, r"load\(strict='False'\): give True or False"),
        ({"threads": 0}, r"load\(threads=0\): give 1\.\.256 reader threads"),
        ({"threads": "8"}, r"load\(threads='8'\): give 1\.\.256 reader threads"),
        ({"threads": 10**6}, r"load\(threads=1000000\): give 1\.\.256 reader threads"),
    ],
)
def test_load_refuses_arguments_restore_refuses(tmp_path, argument, message):
    """restore() refuses a flag that is not a bool and the engine 0 or 10**6 reader threads;
    load() took them: allow_cast="no" cast a float32 version into a float64 model,
    strict="False" was strict, threads="8" failed with a raw comparison error."""
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt:
        ckpt.save(1).wait()
    model = torch.nn.Linear(2, 2).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=message):
        pcframe.load(tmp_path, model=model, **argument)
    assert state_equal(model.state_dict(), before)


def test_a_version_folder_given_as_the_directory_is_refused_naming_its_parent(tmp_path):
    """pcframe.load("ckpts/v00000001") found no version inside the version's folder and said
    "no checkpoint" (an INFO line): an evaluation read a fresh model. A Checkpointer opened
    there wrote its lock, .starts and .clean-exit into the committed version's folder."""
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt:
        ckpt.save(step=3).wait()
    folder = tmp_path / "v00000001"
    files = sorted(p.name for p in folder.iterdir())
    message = rf"{folder} is the folder of one version; give its parent, {tmp_path}, .*version=1"
    model = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(pcframe.CheckpointError, match=message):
        pcframe.load(folder, model=model)
    with pytest.raises(pcframe.CheckpointError, match=message):
        Checkpointer(folder, model=model)
    assert state_equal(model.state_dict(), before)
    assert sorted(p.name for p in folder.iterdir()) == files
    own = tmp_path / "outputs"  # a folder of the user's with a manifest.json of its own
    own.mkdir()
    (own / "manifest.json").write_text('{"name": "my dataset"}')
    assert pcframe.load(own, model=model).step is None
    with Checkpointer(own, model=model) as ckpt:
        assert ckpt.restore() is None


# A world of one gloo rank (its own process: the process group is global) saves a version.
MULTI_RANK_JOB = """
import sys, torch
import torch.distributed as dist
from pcframe.distributed import DistributedCheckpointer

root, rendezvous = sys.argv[1:3]
dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=0, world_size=1)
with DistributedCheckpointer(root, model=torch.nn.Linear(4, 2)) as saving:
    saving.save(5).wait()
dist.destroy_process_group()
"""


def test_a_multi_rank_root_is_named_not_taken_for_an_empty_folder(tmp_path, python, child_env):
    """A DistributedCheckpointer's root holds rank-<r>/ folders, no version of its own:
    load() and restore() reported "no checkpoint" (an INFO line), so an evaluation read a
    fresh model and a training run started again from step 0 beside the job's versions."""
    root = tmp_path / "ckpt"
    args = [python, "-c", MULTI_RANK_JOB, str(root), str(tmp_path / "rendezvous")]
    done = subprocess.run(args, env=child_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    message = r"ckpt holds the checkpoints of a multi-rank job \(rank-0\).*DistributedCheckpointer"
    model = torch.nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(pcframe.CheckpointError, match=message):
        pcframe.load(root, model=model)
    with (
        Checkpointer(root, model=model) as ckpt,
        pytest.raises(pcframe.CheckpointError, match=message),
    ):
        ckpt.restore()
    assert state_equal(model.state_dict(), before)


def test_load_while_its_writer_commits_and_prunes_reads_the_new_version(tmp_path, monkeypatch):
    """An eval job loads while training saves with keep_last=1: the version it listed is
    deleted by the writer's retention before it is read. Before, load called it corrupt
    and raised NoValidCheckpoint although a newer valid version was there."""
    import pcframe.restore.restorer as load_module

    model = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path, model=model, keep_last=1) as writer:
        writer.save(1).wait()
        listing = load_module.CheckpointDir.committed_versions
        calls = []

        def listed_then_the_writer_moves_on(self):
            versions = listing(self)
            if type(self) is not load_module.CheckpointDir:  # the writer's own listing
                return versions
            calls.append(versions)
            if len(calls) == 1:  # the race's window, made certain: v2 commits, v1 is pruned
                torch.nn.init.ones_(model.weight)
                writer.save(2).wait()
            return versions

        monkeypatch.setattr(
            load_module.CheckpointDir, "committed_versions", listed_then_the_writer_moves_on
        )
        reader = torch.nn.Linear(4, 4)
        report = pcframe.load(tmp_path, model=reader)
    assert calls[0] == [1] and report.step == 2
    assert torch.equal(reader.weight, torch.ones(4, 4))


def test_load_of_a_directory_it_cannot_list_is_one_line(tmp_path, python, child_env):
    with Checkpointer(tmp_path / "ckpt", model=torch.nn.Linear(2, 2)) as c:
        c.save(1).wait()
    command = [
        python,
        "-c",
        (
            "import sys, torch, pcframe\n"
            "try:\n"
            "    pcframe.load(sys.argv[1], model=torch.nn.Linear(2, 2))\n"
            "except pcframe.CheckpointError as exc:\n"
            "    print(type(exc).__name__, exc)\n"
        ),
        str(tmp_path / "ckpt"),
    ]
    if os.geteuid() == 0:  # root reads through mode bits: drop the capabilities that allow it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: mode bits cannot stop reads")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    os.chmod(tmp_path / "ckpt", 0o311)  # enter, but not list
    try:
        proc = subprocess.run(command, env=child_env, capture_output=True, text=True)
    finally:
        os.chmod(tmp_path / "ckpt", 0o755)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("RestoreIOError cannot list"), proc.stdout
    assert "Permission denied" in proc.stdout and proc.stdout.count("\n") == 1
