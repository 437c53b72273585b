"""A checkpoint directory pcframe-run cannot use is refused before any step is trained.

Before, the Checkpointer of the checkpointed run found it, after the warm-up and the first
baseline run (15 s and more), and the run ended as a failure (exit 1, not 2).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pcframe import Checkpointer
from pcframe.apps.errors import USAGE_ERROR, describe_error
from pcframe.apps.preflight import check_run_directory
from pcframe.apps.run import run_supervised
from pcframe.apps.workloads import build
from pcframe.errors import ConfigError, DirectoryLocked
from pcframe.store.directory import LOCK
from tests.apps.conftest import compose, run_module

TINY = {"hidden": 64, "layers": 2, "samples": 256}  # conf/workload/tiny.yaml, fewer samples


def saved(directory: Path, **workload_args) -> Path:
    """``directory`` holding one committed version of an MLP workload with those args."""
    w = build("mlp", **{**TINY, **workload_args})
    objects = dict(model=w.model, optimizer=w.optimizer, scheduler=w.scheduler, data=w.loader)
    with Checkpointer(directory, **objects) as ckpt:
        ckpt.save(step=1).wait()
    return directory


def newer_format(directory: Path) -> Path:
    """The version's header says a format this pcframe cannot read (a newer pcframe's)."""
    (manifest,) = directory.glob("v*/manifest.json")
    header, body = manifest.read_bytes().split(b"\n", 1)
    manifest.write_bytes(
        json.dumps(json.loads(header) | {"format_version": 99}).encode() + b"\n" + body
    )
    return directory


def a_file(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("not a folder")
    return tmp_path / "notes.txt"


def under_a_file(tmp_path: Path) -> Path:
    return a_file(tmp_path) / "ckpts"


def unwritable_parent(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        parent = tmp_path / "read-only"
        parent.mkdir(mode=0o500)
        return parent / "ckpts"
    # root writes through any mode bits; /sys refuses new entries to root too
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no /sys here to stand for a folder root cannot write into")
    return Path("/sys/pcframe-test-ckpts")


def another_model(tmp_path: Path) -> Path:
    return saved(tmp_path / "ckpts", hidden=32)


def a_newer_format(tmp_path: Path) -> Path:
    return newer_format(saved(tmp_path / "ckpts"))


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (a_file, "is a file, not a folder"),
        (under_a_file, "is a file, so no folder can be made under it"),
        (unwritable_parent, "cannot write into"),
        (another_model, "holds checkpoints of another model or setup"),
        (a_newer_format, "holds checkpoints of a newer pcframe"),
    ],
    ids=lambda v: getattr(v, "__name__", None) or "",
)
def test_a_directory_the_run_cannot_use_is_one_usage_line(tmp_path, make, words):
    directory = make(tmp_path)
    with pytest.raises(ConfigError) as info:
        check_run_directory(directory, build("mlp", **TINY))
    code, line = describe_error(info.value, "run")
    assert code == USAGE_ERROR and "\n" not in line
    assert line.startswith(f"directory={directory}") and words in line
    assert "give" in line or "upgrade" in line  # the fix, not just the fault
    assert "strict=False" not in line  # the library's advice means nothing to an app user


def test_usable_directories_pass_and_the_check_leaves_no_trace(tmp_path):
    fresh = tmp_path / "new" / "deeper"
    check_run_directory(fresh, build("mlp", **TINY))
    assert not (tmp_path / "new").exists()  # the run creates it, not the check

    directory = saved(tmp_path / "ckpts")  # the same model: the run resumes it
    before = sorted(p.name for p in directory.iterdir())
    workload = build("mlp", **TINY)
    torch.manual_seed(123)  # not the state the checkpoint holds
    state = torch.random.get_rng_state()
    check_run_directory(directory, workload)
    # load() put the checkpoint's RNG state in; the check puts this process's back
    assert torch.equal(torch.random.get_rng_state(), state)
    assert sorted(p.name for p in directory.iterdir()) == before  # nothing written


def test_a_supervised_run_refuses_it_before_the_reference_run(tmp_path):
    directory = another_model(tmp_path)
    cfg = compose(
        "run", "workload=tiny", "threads=1", "steps=20", "progress=false", "failure=poisson",
        f"hydra.run.dir={tmp_path / 'out'}", directory=directory,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="another model or setup"):
        run_supervised(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "reference-checkpoints").exists()


# A writer's lock as a running pcframe-run holds it (flock on .writer.lock, its pid inside),
# without the 2-4 s of importing torch; held until its stdin closes.
HOLD = (
    "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
    "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'%d\\n' % os.getpid()); "
    "print('held', flush=True); sys.stdin.read()"
)


@contextlib.contextmanager
def locked_by_another_process(directory: Path) -> Iterator[int]:
    """``directory`` with its writer lock held by a live process; that process's pid."""
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-c", HOLD, str(directory / LOCK)]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as holder:
        assert holder.stdout.readline() == b"held\n"  # taken: no sleep, no race
        try:
            yield holder.pid
        finally:
            holder.stdin.close()


def test_a_directory_another_process_writes_to_is_refused_first_and_late(tmp_path):
    """A second pcframe-run on a folder in use was refused only after the warm-up, by its
    Checkpointer's open, with exit code 1. The lock is looked at, never taken."""
    directory = saved(tmp_path / "ckpts")
    with locked_by_another_process(directory) as pid:
        with pytest.raises(ConfigError) as info:
            check_run_directory(directory, build("mlp", **TINY))
        code, line = describe_error(info.value, "run")
        assert code == USAGE_ERROR and "\n" not in line
        assert line.startswith(f"directory={directory} is in use: ") and f"(pid {pid})" in line
        # One that takes the folder after the check is found by the Checkpointer: exit 2 too.
        with pytest.raises(DirectoryLocked) as late:
            Checkpointer(directory, model=torch.nn.Linear(2, 2))
        assert describe_error(late.value, "run")[0] == USAGE_ERROR
    check_run_directory(directory, build("mlp", **TINY))  # free again: passes


@pytest.mark.slow
def test_pcframe_run_on_a_directory_in_use_is_one_line_with_exit_2_before_training(
    tmp_path, app_env
):
    directory = tmp_path / "ckpts"
    with locked_by_another_process(directory) as pid:
        result = run_module(
            "pcframe.apps.run", "workload=tiny", "threads=1", "steps=20",
            f"directory={directory}", f"hydra.run.dir={tmp_path / 'out'}",
            cwd=tmp_path, env=app_env,
        )  # fmt: skip
    assert result.returncode == USAGE_ERROR, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()  # not even the warm-up's progress line
    assert line.startswith(f"pcframe-run: error: directory={directory} is in use: ")
    assert f"another live process (pid {pid})" in line and "Traceback" not in result.stderr


@pytest.mark.slow
def test_pcframe_run_says_it_in_one_line_with_exit_2_before_training(tmp_path, app_env):
    directory = another_model(tmp_path)
    result = run_module(
        "pcframe.apps.run", "workload=tiny", "threads=1", "steps=20", f"directory={directory}",
        f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path, env=app_env,
    )  # fmt: skip
    assert result.returncode == USAGE_ERROR, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()  # not even the warm-up's progress line
    assert line.startswith(f"pcframe-run: error: directory={directory} holds checkpoints")
    assert "Traceback" not in result.stderr


def test_an_empty_or_url_directory_and_one_past_the_steps_are_refused(tmp_path):
    """``directory=`` made the working directory the checkpoint folder, ``s3://b/x`` made a
    local folder named ``s3:``, and a rerun on a folder already past ``steps`` reported
    negative steps per second with exit code 0."""
    for given, words in (
        ("", "names no folder"),
        ("  ", "names no folder"),
        ("s3://b/x", "is a URL"),
    ):
        with pytest.raises(ConfigError, match=words):
            check_run_directory(given, build("mlp", **TINY))
    assert not (Path.cwd() / "s3:").exists()
    folder = saved(tmp_path / "ckpt")  # step 1
    with pytest.raises(ConfigError, match=r"already holds step 1, at or past steps=1: "):
        check_run_directory(folder, build("mlp", **TINY), steps=1)
    check_run_directory(folder, build("mlp", **TINY), steps=2)  # one step left: resumed
