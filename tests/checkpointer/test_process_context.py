"""The process around a Checkpointer: its working directory changing, and children forked
from it. Neither may send its writes, deletes or exit marks anywhere but its own folder."""

from __future__ import annotations

import os
import subprocess

from pcframe import Checkpointer
from pcframe.store.directory import CheckpointDir
from tests.helpers import small_training, train_steps


def test_a_relative_folder_stays_where_it_was_when_the_working_directory_changes(
    tmp_path, monkeypatch
):
    """Before: every save after an os.chdir() went to the new directory's folder of that
    name, and retention there deleted another run's versions."""
    other_run = tmp_path / "elsewhere" / "ckpt"
    model, optimizer, scheduler = small_training()
    with Checkpointer(other_run, model=model, optimizer=optimizer, keep_last=2) as ckpt:
        for step in (101, 102):
            ckpt.save(step).wait()
    monkeypatch.chdir(tmp_path)
    with Checkpointer("ckpt", model=model, optimizer=optimizer, keep_last=2) as ckpt:
        ckpt.save(1).wait()
        os.chdir(tmp_path / "elsewhere")
        for step in (2, 3, 4):
            train_steps(model, optimizer, scheduler, 1)
            ckpt.save(step).wait()
    assert CheckpointDir(tmp_path / "ckpt").committed_versions() == [3, 4]
    assert CheckpointDir(other_run).committed_versions() == [1, 2]


FORK_AND_EXIT = """
import os, sys, time, torch
from pcframe import Checkpointer
from tests.helpers import small_training, train_steps
model, optimizer, scheduler = small_training()
ckpt = Checkpointer(sys.argv[1], model=model, optimizer=optimizer, save_last=True)
ckpt.save(1).wait()
train_steps(model, optimizer, scheduler, 1)  # step 2 unsaved: save_last would save it
started = time.monotonic()
pid = os.fork()
if pid == 0:  # the child exits the normal way, through atexit
    with torch.no_grad():
        next(model.parameters()).fill_(123.0)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
marked = os.path.exists(os.path.join(sys.argv[1], ".clean-exit"))
print(os.waitstatus_to_exitcode(status), round(time.monotonic() - started), marked, flush=True)
os.kill(os.getpid(), 9)  # the parent is preempted: no clean exit of its own
"""


def test_a_forked_child_that_exits_leaves_the_parents_folder_alone(tmp_path, python, child_env):
    """Before: the child's exit ran the parent's close (registered at exit): it waited for
    engine threads the child does not have (600 s), saved the child's changed state, or
    wrote the parent's clean-exit mark, and a parent SIGKILLed later restarted as if it had
    exited cleanly."""
    run = subprocess.run(
        [python, "-c", FORK_AND_EXIT, str(tmp_path)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == -9, run.stderr
    code, seconds, marked = run.stdout.split()
    assert (code, marked) == ("0", "False") and int(seconds) < 60, run.stdout
    assert not (tmp_path / ".clean-exit").exists()
    assert CheckpointDir(tmp_path).committed_versions() == [1]
    model, optimizer, _ = small_training(seed=3)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() == 1
