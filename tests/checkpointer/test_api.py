"""The Checkpointer API: optimizer gating, the writer lock, policies, configuration errors."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import pcframe
from pcframe import Checkpointer, CheckpointError, ConfigError, DirectoryLocked, EngineConfig
from pcframe.policies import Decision, FixedSteps, IntervalPolicy, Notice, Restarted, SaveCompleted
from pcframe.runtime.collector import current_frames
from pcframe.save.fill import Filler
from pcframe.save.status import SaveStatus
from pcframe.store.directory import CheckpointDir
from pcframe.store.retention import KeepWhere
from tests.helpers import (
    StateBox,
    commits_in_save_order,
    small_training,
    state_equal,
    train_steps,
)


def test_optimizer_step_waits_for_the_snapshot(tmp_path, monkeypatch):
    """Steps right after save() must not leak into the checkpoint (mixed-step checkpoints).

    The snapshot's copy starts only once the training thread has reached the next
    ``optimizer.step()`` (a hook of the test's, registered before the engine's, says so) and
    then gives that step half a second to finish: with the gate the step is still waiting
    when the copy starts, however the threads are scheduled; without it the step has
    changed the tensors before they are copied."""
    model, optimizer, scheduler = small_training()
    train_steps(model, optimizer, scheduler, 2)
    step_reached, step_done = threading.Event(), threading.Event()
    optimizer.register_step_pre_hook(lambda *_: step_reached.set())
    optimizer.register_step_post_hook(lambda *_: step_done.set())
    step_finished_before_the_copy: list[bool] = []
    first_chunk = threading.Lock()  # the copy may run on several threads
    original_fill = Filler.chunk

    def fill_once_the_step_is_reached(self, *args):
        with first_chunk:
            if not step_finished_before_the_copy:
                assert step_reached.wait(timeout=30)
                step_finished_before_the_copy.append(step_done.wait(timeout=0.5))
        original_fill(self, *args)

    monkeypatch.setattr(Filler, "chunk", fill_once_the_step_is_reached)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, chunk_bytes=4096) as ckpt:
        ckpt.save(step=2)
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        moments = {k: v.clone() for k, v in optimizer.state[next(model.parameters())].items()}
        train_steps(model, optimizer, scheduler, 3)
        ckpt.wait()
        assert step_finished_before_the_copy == [False]
        assert ckpt.records[1].stall >= 0.4  # the step waited for the copy
    model2, optimizer2, _ = small_training(seed=4)
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2) as ckpt:
        ckpt.restore()
    assert state_equal(model2.state_dict(), snapshot)
    assert state_equal(optimizer2.state[next(model2.parameters())], moments)


def test_a_second_writer_is_refused_until_the_first_dies(tmp_path, python, child_env):
    holder = subprocess.Popen(
        [
            python,
            "-c",
            "import sys, time, torch; from pcframe import Checkpointer;"
            "c = Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2)); print('ok', flush=True);"
            "time.sleep(60)",
            str(tmp_path),
        ],
        env=child_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "ok"
    with pytest.raises(DirectoryLocked, match=rf"pid {holder.pid}.*only one writer"):
        Checkpointer(tmp_path, model=torch.nn.Linear(2, 2))
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
    Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)).close()  # the lock died with it


def test_a_child_forked_by_a_dead_writer_does_not_keep_its_lock(tmp_path, python, child_env):
    """A DataLoader worker or multiprocessing helper is forked without exec and inherited
    the lock's open file (and so the flock): after the writer was killed, a restart found
    the directory "written by another live process" for as long as the child lived."""
    writer = subprocess.Popen(
        [
            python,
            "-c",
            "import multiprocessing as mp, sys, time, torch; from pcframe import Checkpointer\n"
            "c = Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2)); c.save(1).wait()\n"
            "child = mp.get_context('fork').Process(target=time.sleep, args=(60,))\n"
            "child.start(); print(child.pid, flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        env=child_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(writer.stdout.readline())
    try:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        os.kill(child, 0)  # the forked child still runs
        with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt:
            assert ckpt.restore() == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        writer.stdout.close()


def test_a_second_writer_in_the_same_process_is_named_as_such(tmp_path):
    """The message says where the open one was made: a notebook cell run again left the
    first open, and the user had no way to tell which object to close."""
    first = Checkpointer(tmp_path, model=torch.nn.Linear(2, 2))
    line = sys._getframe().f_lineno - 1
    try:
        with pytest.raises(DirectoryLocked, match="already has a Checkpointer open in this") as err:
            Checkpointer(tmp_path / ".", model=torch.nn.Linear(2, 2))
        assert f"(opened at {__file__}:{line})" in str(err.value)
        assert "call close() on that one first" in str(err.value)
    finally:
        first.close()
    Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)).close()  # closed: the folder is free


class EveryThird(IntervalPolicy):
    name = "every_third"

    def __init__(self):
        self.completed: list[SaveCompleted] = []
        self.seen_costs: list[tuple] = []

    def decide(self, ctx):
        self.seen_costs.append((ctx.iteration_time, ctx.save_stall, ctx.save_duration))
        return Decision(ctx.step % 3 == 0, "third")

    def observe(self, event):
        if isinstance(event, SaveCompleted):
            self.completed.append(event)

    def state_dict(self):
        return {"completed": len(self.completed)}

    def load_state_dict(self, state):
        self.restored = state


def test_policy_decides_learns_measurements_and_is_restored(tmp_path):
    policy = EveryThird()
    model, optimizer, scheduler = small_training()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=policy) as ckpt:
        # Two in flight: the version of step 3 finishing after step 6's would be discarded
        # (by design), and neither completed nor counted in the restored policy state.
        commits_in_save_order(ckpt)
        handles = []
        for step in range(1, 13):
            train_steps(model, optimizer, scheduler, 1)
            handles.append(ckpt.maybe_save(step))
            if step == 9:
                ckpt.wait()  # so the policy state saved at step 12 has seen 3 completions
            time.sleep(0.002)
        ckpt.wait()
    saved = [h.step for h in handles if h is not None]
    assert saved == [3, 6, 9, 12]
    assert [e.step for e in policy.completed] == [3, 6, 9, 12]
    assert all(e.duration >= e.stall >= 0 and e.nbytes > 0 for e in policy.completed)
    iteration, stall, duration = policy.seen_costs[-1]
    assert iteration > 0.002 and stall is not None and duration is not None
    restored_policy = EveryThird()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=restored_policy) as c:
        assert c.restore() == 12
    assert restored_policy.restored == {"completed": 3}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_in_flight", 0, "engine.max_in_flight=0"),
        ("chunk_bytes", 1000, "multiple of 4096"),
        ("keep_last", 0, "keep at least 1"),
        ("checksum", "md5", "crc32c"),
        ("o_direct", "maybe", "'off', 'on' or 'auto'"),
    ],
)
def test_bad_config_names_key_and_fix(key, value, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{key: value})


def test_unknown_override_is_refused(tmp_path):
    with pytest.raises(TypeError, match="max_inflight"):
        Checkpointer(tmp_path, max_inflight=2)


@pytest.mark.parametrize("o_direct", ["auto", "off"])
@pytest.mark.parametrize("checksum", ["crc32c", "xxh3_64", "none"])
def test_engine_options_round_trip(tmp_path, o_direct, checksum):
    model, optimizer, scheduler = small_training()
    train_steps(model, optimizer, scheduler, 1)
    with Checkpointer(
        tmp_path,
        model=model,
        optimizer=optimizer,
        o_direct=o_direct,
        checksum=checksum,
        chunk_bytes=8192,
    ) as ckpt:
        ckpt.save(step=1).wait()
    model2, optimizer2, _ = small_training(seed=9)
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2) as ckpt:
        assert ckpt.restore() == 1
    assert state_equal(model.state_dict(), model2.state_dict())


def test_mismatched_model_gives_clear_error(tmp_path):
    with Checkpointer(tmp_path, model=torch.nn.Linear(4, 4)) as ckpt:
        ckpt.save(step=1).wait()
    from pcframe import CheckpointError

    with (
        Checkpointer(tmp_path, model=torch.nn.Linear(4, 5)) as ckpt,
        pytest.raises(CheckpointError, match="does not fit the objects given"),
    ):
        ckpt.restore()


class WithMask(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(1).expand(4))  # a broadcast view


def test_a_broadcast_buffer_is_named_before_anything_is_loaded(tmp_path):
    with Checkpointer(tmp_path, model=WithMask()) as ckpt:
        ckpt.save(step=1).wait()
    fresh = WithMask()
    before = fresh.linear.weight.detach().clone()
    with Checkpointer(tmp_path, model=fresh) as ckpt:
        with pytest.raises(CheckpointError, match=r"model\['mask'\]: .*broadcast view") as info:
            ckpt.restore()
        assert "rolling it back" not in str(info.value)
        assert torch.equal(fresh.linear.weight, before)  # nothing was loaded
        assert ckpt.restore(strict=False) == 1  # the rest fits and loads
        assert ckpt.last_restore.not_loaded and "mask" in " ".join(ckpt.last_restore.not_loaded)
    assert not torch.equal(fresh.linear.weight, before)


@pytest.mark.parametrize(
    ("asked", "error", "message"),
    [
        ("2", TypeError, r"takes a version number .* got '2' \(str\)"),
        (True, TypeError, r"got True \(bool\)"),  # else True would read version 1
        (2.0, TypeError, r"got 2.0 \(float\)"),
        (0, CheckpointError, "version 0 cannot exist"),
        (-1, CheckpointError, "version -1 cannot exist"),
    ],
)
def test_a_version_that_cannot_name_a_folder_is_refused_and_changes_nothing(
    tmp_path, asked, error, message
):
    model = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path, model=model) as ckpt:
        ckpt.save(step=1).wait()
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save(step=2).wait()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(error, match=message):
            ckpt.restore(version=asked)
        assert state_equal(model.state_dict(), before)
        assert ckpt.restore(version=1) == 1 and ckpt.committed_versions() == [1, 2]
    with pytest.raises(error, match=message):
        pcframe.load(tmp_path, model=model, version=asked)  # read-only loading: the same


def test_commit_listeners_retention_filter_and_forced_versions(tmp_path):
    seen = []
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), keep_last=1) as ckpt:
        ckpt.add_commit_listener(
            lambda v, path, manifest: seen.append((v, path.name, manifest.step))
        )
        ckpt.add_commit_listener(lambda *args: 1 / 0)  # a failing listener does not undo commits
        ckpt.retention.add(KeepWhere("test", lambda committed: {1}))
        ckpt.save(step=1).wait()
        ckpt.save(step=2).wait()
        ckpt.save(step=3, version=10).wait()
        with pytest.raises(CheckpointError, match="not above the last version 10"):
            ckpt.save(step=4, version=10)
    assert seen == [(1, "v00000001", 1), (2, "v00000002", 2), (10, "v00000010", 3)]
    assert CheckpointDir(tmp_path).committed_versions() == [1, 10]  # 1 protected, 2 deleted


def test_save_record_counts_the_engine_threads_cpu_and_not_the_training_threads(
    tmp_path, monkeypatch
):
    def busy_crash_point(name: str) -> None:
        if name == "chunk_written":  # inside a writer's measured work: the engine's cost
            burn_cpu(0.03)

    monkeypatch.setattr("pcframe.save.write.crash_point", busy_crash_point)
    model, optimizer, scheduler = small_training()
    train_steps(model, optimizer, scheduler, 1)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, chunk_bytes=4096) as ckpt:
        handle = ckpt.save(step=1)
        burn_cpu(0.5)  # training's CPU while the save is in flight: not the engine's
        handle.wait()
        chunks = len(ckpt._pipeline.opener._plan.layout.chunks)
        record = ckpt.records[handle.version]
    assert chunks >= 2
    assert 0.03 * chunks <= record.cpu < 0.03 * chunks + 0.4


def burn_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class RecordsRestarts(FixedSteps):
    def __init__(self) -> None:
        super().__init__(1000)
        self.restarts: list[Restarted] = []

    def observe(self, event) -> None:
        super().observe(event)
        if isinstance(event, Restarted):
            self.restarts.append(event)


def restart_after(tmp_path) -> Restarted:
    model, optimizer, _ = small_training()
    policy = RecordsRestarts()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=policy) as ckpt:
        assert ckpt.restore() == 1
    (event,) = policy.restarts
    return event


def test_a_restart_says_whether_the_previous_run_closed_cleanly(tmp_path, python, child_env):
    model, optimizer, scheduler = small_training()
    train_steps(model, optimizer, scheduler, 1)
    with Checkpointer(tmp_path / "closed", model=model, optimizer=optimizer) as ckpt:
        ckpt.save(step=1)
    assert restart_after(tmp_path / "closed").clean
    # A process that exits without closing (os._exit skips atexit: like a SIGKILL).
    script = (
        "import os, sys; from pcframe import Checkpointer;"
        "from tests.helpers import small_training; m, o, _ = small_training();"
        "c = Checkpointer(sys.argv[1], model=m, optimizer=o); c.save(step=1).wait();"
        "os._exit(0)"
    )
    subprocess.run([python, "-c", script, str(tmp_path / "died")], env=child_env, check=True)
    assert not restart_after(tmp_path / "died").clean
    # A run that closed with a preemption notice pending was preempted.
    with Checkpointer(tmp_path / "noticed", model=model, optimizer=optimizer) as ckpt:
        ckpt.save(step=1)
        now = time.monotonic()
        ckpt._decisions.notice = Notice(received_at=now, deadline=now + 30.0, source="test")
    assert not restart_after(tmp_path / "noticed").clean


def test_a_save_error_caused_by_another_says_the_checkpoint_is_intact_once():
    """A multi-rank round wraps a rank's SaveError: its message said the suffix twice ("..")."""
    from pcframe.errors import INTACT, SaveError

    inner = SaveError(3, 9, "persist", OSError(27, "File too large"))
    outer = SaveError(3, 9, "round", CheckpointError(f"not global: rank 1 failed: {inner}"))
    assert str(outer).count(INTACT) == 1 and ".." not in str(outer)
    assert "File too large" in str(outer) and str(outer).endswith(INTACT)


def test_saves_from_two_threads_get_distinct_versions_and_all_commit(tmp_path):
    """A loop and a notice handler's thread saving at once: before, both took the same
    version number; one was discarded as not newer, or failed on the other's folder."""
    import threading

    failures: list[BaseException] = []
    with Checkpointer(tmp_path, model=torch.nn.Linear(64, 64), max_in_flight=4, keep_last=100) as c:
        # Up to 4 in flight: one whose writes finish after a newer one's was discarded (by
        # design) when the machine was busy. The numbers and commits are what is tested.
        commits_in_save_order(c)

        def saves(first_step: int) -> None:
            for step in range(first_step, first_step + 25):
                try:
                    c.save(step=step)
                except BaseException as exc:
                    failures.append(exc)

        threads = [threading.Thread(target=saves, args=(base,)) for base in (1000, 2000)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        c.wait()
        statuses = {str(record.status) for record in c.records.values()}
    assert not failures and statuses == {"committed"}
    assert CheckpointDir(tmp_path).committed_versions() == list(range(1, 51))


class HalfwayStep(torch.optim.SGD):
    """SGD that stops half-way through its update until ``resume()`` says go on: the first
    weight is updated, the second not yet."""

    def __init__(self, params, resume):
        super().__init__(params, lr=1.0)
        self.resume = resume

    @torch.no_grad()
    def step(self, closure=None):
        first, second = self.param_groups[0]["params"]
        first.add_(1.0)
        self.resume()
        second.add_(1.0)


def _blocked_in(thread: threading.Thread, function: str) -> bool:
    frame = current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def test_a_save_from_another_thread_waits_for_the_optimizer_step_in_progress(tmp_path):
    """A watcher thread's save() while the loop is inside optimizer.step(): its capture read
    some weights after the update and the rest before it, and the version committed torn
    (1 to 3 in 250 saves with stock SGD). Now the save waits for the step's end."""
    weights = [torch.nn.Parameter(torch.zeros(1024)) for _ in range(2)]
    model = torch.nn.ParameterList(weights)
    done = threading.Event()
    handles = []

    def save() -> None:  # and its snapshot copied (from the weights as they are then)
        handles.append(ckpt.save(step=1))
        ckpt.wait_for_snapshot()
        done.set()

    watcher = threading.Thread(target=save)

    def resume() -> None:  # the watcher saves now; the update goes on once it saved or waits
        watcher.start()
        deadline = time.monotonic() + 60
        while not done.is_set() and not _blocked_in(watcher, "_other_steps"):
            assert time.monotonic() < deadline, "the watcher neither saved nor waited"
            time.sleep(0.005)

    optimizer = HalfwayStep(model.parameters(), resume)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        optimizer.step()
        watcher.join(timeout=60)
        assert handles[0].wait() is SaveStatus.COMMITTED
        fresh = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.full((1024,), 7.0)) for _ in range(2)]
        )
    with Checkpointer(tmp_path, model=fresh) as again:
        again.restore()
    assert torch.equal(fresh[0], fresh[1]), "a version holds weights of two steps"
    assert torch.equal(fresh[0], torch.ones(1024))  # the whole step


def test_a_step_that_raised_does_not_hold_other_threads_saves(tmp_path):
    """An optimizer.step() that raises half-way never reaches its post-hook: another
    thread's save goes on once the step's frame is gone, instead of waiting for ever."""
    weights = [torch.nn.Parameter(torch.zeros(16)) for _ in range(2)]

    def fail() -> None:
        raise RuntimeError("the update failed")

    optimizer = HalfwayStep(weights, fail)
    with Checkpointer(tmp_path, model=torch.nn.ParameterList(weights), optimizer=optimizer) as ckpt:
        with pytest.raises(RuntimeError, match="the update failed"):
            optimizer.step()
        results = []
        saver = threading.Thread(target=lambda: results.append(ckpt.save(step=1).wait()))
        saver.start()
        saver.join(timeout=60)
        assert results == [SaveStatus.COMMITTED]


def test_a_refused_optimizer_takes_its_lr_from_the_restored_scheduler(tmp_path):
    """strict=False with the optimizer refused (another class) and the scheduler loaded: the
    fresh optimizer kept its starting lr, 0.1, while the scheduler stood at epoch 3 (lr
    0.0125), and a chainable schedule went on from 0.1. The lr now follows the schedule."""

    def objects(kind):
        model = torch.nn.Linear(4, 4)
        optimizer = kind(model.parameters(), lr=0.1)
        return model, optimizer, torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.5)

    model, optimizer, schedule = objects(torch.optim.SGD)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=schedule) as ckpt:
        for _ in range(3):
            optimizer.step()
            schedule.step()
        ckpt.save(step=3).wait()
    model, optimizer, schedule = objects(torch.optim.Adam)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=schedule) as ckpt:
        assert ckpt.restore(strict=False) == 3
        assert any("optimizer" in line for line in ckpt.last_restore.not_loaded)
    assert schedule.last_epoch == 3
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.0125])
    optimizer.step()
    schedule.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.00625])


@pytest.mark.parametrize(
    "other",
    [
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10),
        # Its keys are a subset of StepLR's: refused only since versions name the class.
        lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.97),
    ],
    ids=["cosine", "exponential"],
)
def test_a_scheduler_of_another_class_is_refused_not_merged(tmp_path, other):
    """LRScheduler.load_state_dict is a __dict__ update: a StepLR's state loaded into a
    CosineAnnealingLR silently made a hybrid with both schedules' fields, and into an
    ExponentialLR (gamma 0.1 instead of 0.97) even past the keys check."""

    def objects(kind):
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, optimizer, kind(optimizer)

    model, optimizer, steps = objects(lambda o: torch.optim.lr_scheduler.StepLR(o, 2))
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=steps) as ckpt:
        for _ in range(3):
            optimizer.step()
            steps.step()
        ckpt.save(step=3).wait()
    model, optimizer, live = objects(other)
    before = dict(live.state_dict())
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=live) as ckpt:
        with pytest.raises(
            CheckpointError,
            match=r"scheduler: the checkpoint's scheduler is a torch.optim.lr_scheduler.StepLR, "
            rf"this one a torch.optim.lr_scheduler.{type(live).__name__}",
        ):
            ckpt.restore()
        assert live.state_dict() == before and not hasattr(live, "step_size")
        assert ckpt.restore(strict=False) == 3  # the model and optimizer fit
        assert live.state_dict() == before and live.last_epoch == before["last_epoch"]
    # The class that was saved still restores.
    model, optimizer, steps = objects(lambda o: torch.optim.lr_scheduler.StepLR(o, 2))
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=steps) as ckpt:
        assert ckpt.restore() == 3 and steps.last_epoch == 3


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({1: "a"}, r"extra: key 1 \(int\)"),  # would come back as {"1": "a"}
        ({"ok": [1, (2, 3)]}, r"extra\['ok'\]\[1\]: a tuple would be restored as a list"),
        ({"deep": {None: 1}}, r"extra\['deep'\]: key None \(NoneType\)"),
    ],
)
def test_extra_that_json_would_change_is_refused_at_save_naming_the_key(tmp_path, extra, where):
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), extra=extra) as ckpt:
        with pytest.raises(TypeError, match=where):
            ckpt.save(step=1)
        extra.clear()
        extra["epoch"] = 3  # fixed: the next save commits
        ckpt.save(step=2).wait()
    fresh: dict = {}
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), extra=fresh) as ckpt:
        assert ckpt.restore() == 2 and fresh == {"epoch": 3}


@pytest.mark.parametrize(
    ("buffer", "message"),
    [
        (lambda: torch.eye(3).to_sparse(), r"'model/odd'.*sparse_coo.*\.to_dense\(\)"),
        (lambda: torch.empty(3, device="meta"), r"'model/odd'.*meta device.*to_empty"),
        (
            lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
            r"'model/odd' of dtype torch.quint8.*dequantize\(\)",
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated
def test_a_tensor_pcframe_cannot_store_is_named_before_a_version_starts(tmp_path, buffer, message):
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path, model=model) as ckpt:
        ckpt.save(step=1).wait()
        model.register_buffer("odd", buffer())
        with pytest.raises(TypeError, match=message):
            ckpt.save(step=2)
        assert list(ckpt.records) == [1]  # refused before a version was numbered or started
        del model.odd
        ckpt.save(step=3).wait()
    assert CheckpointDir(tmp_path).committed_versions() == [1, 2]


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            lambda: {0: torch.ones(1), "0": torch.zeros(1)},
            r"two tensors are both at 'stateful/h/0'",
        ),
        (lambda: {"a": [torch.ones(1)], "a/0": torch.zeros(1)}, r"both at 'stateful/h/a/0'"),
        (lambda: {"k" * 5000: torch.ones(1)}, r"5011 characters, over the 4096"),
        (
            lambda: {"z": torch.empty(0, 2**57)},
            r"'stateful/h/z' of shape \[0, 144115188075855872\]",
        ),
        (lambda: {"ok": torch.ones(2).to_sparse()}, r"'stateful/h/ok'.*sparse_coo"),
        (lambda: {"ok": torch.empty(2, device="meta")}, r"'stateful/h/ok'.*meta device"),
    ],
    ids=["int-and-str-key", "slash-key", "long-key", "empty-huge", "turned-sparse", "turned-meta"],
)
def test_state_a_reader_would_refuse_is_refused_at_save_not_quarantined_later(
    tmp_path, state, message
):
    """Each of these was committed, then moved aside as corrupt by the next restore (the
    tensor names collide, a name is over the reader's limit, an empty shape no reader
    builds), or failed deep inside save() (a tensor that turned sparse or meta under the
    same name and shape as before: the checks ran only when the layout changed)."""
    holder = StateBox({"ok": torch.ones(2)})
    with Checkpointer(tmp_path, stateful={"h": holder}) as ckpt:
        ckpt.save(step=1).wait()
        holder.state = state()
        with pytest.raises((TypeError, ValueError), match=message):
            ckpt.save(step=2)
    assert CheckpointDir(tmp_path).committed_versions() == [1]
    back = StateBox({})
    with Checkpointer(tmp_path, stateful={"h": back}) as ckpt:
        assert ckpt.restore() == 1 and not ckpt.last_restore.skipped


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_a_nested_tensor_is_named_at_save_not_an_internal_error(tmp_path):
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with (
        Checkpointer(tmp_path, stateful={"h": StateBox({"x": nested})}) as ckpt,
        pytest.raises(TypeError, match=r"nested tensor at '/stateful/h/x'.*unbind"),
    ):
        ckpt.save(step=1)


def _layers(*names):
    from collections import OrderedDict

    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict((n, torch.nn.Linear(8, 8)) for n in names))


def _adam_trained(model):
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    return optimizer


def test_optimizer_state_follows_parameter_names_not_positions(tmp_path):
    """torch keys optimizer state by position: modules registered in another order (same
    names, same shapes) loaded a's Adam moments into b, and a renamed layer's moments went
    to the fresh layer under strict=False, with nothing in the report. Now each moment goes
    to the parameter of its name, and state of a name the model lacks is refused."""
    model = _layers("a", "b")
    optimizer = _adam_trained(model)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(step=1).wait()
    swapped = _layers("b", "a")
    swapped_optimizer = _adam_trained(swapped)  # live moments: the restore reads into them
    with Checkpointer(tmp_path, model=swapped, optimizer=swapped_optimizer) as ckpt:
        assert ckpt.restore() == 1
    for name in ("a", "b"):
        for kind in ("weight", "bias"):
            was = optimizer.state[getattr(getattr(model, name), kind)]
            now = swapped_optimizer.state[getattr(getattr(swapped, name), kind)]
            assert torch.equal(now["exp_avg"], was["exp_avg"]), (name, kind)
            assert torch.equal(now["exp_avg_sq"], was["exp_avg_sq"]), (name, kind)
    renamed = _layers("a", "middle")
    fresh = torch.optim.Adam(renamed.parameters())
    with Checkpointer(tmp_path, model=renamed, optimizer=fresh) as ckpt:
        with pytest.raises(
            CheckpointError, match=r"holds state of \['b\.weight', 'b\.bias'\] and none of"
        ):
            ckpt.restore()
        assert ckpt.restore(strict=False) == 1
        assert not fresh.state  # no moments for parameters whose weights were not loaded
        assert any("'b.weight'" in line for line in ckpt.last_restore.not_loaded)
    same = _layers("a", "b")
    fresh = torch.optim.Adam(same.parameters())
    with Checkpointer(tmp_path, model=same, optimizer=fresh) as ckpt:  # the same definition
        assert ckpt.restore() == 1
        assert torch.equal(
            fresh.state[same.b.weight]["exp_avg"], optimizer.state[model.b.weight]["exp_avg"]
        )
    # The step after the restore matches the original's (the same function: a(x) + b(x)).
    batch = torch.randn(4, 8)
    for net, opt in ((model, optimizer), (swapped, swapped_optimizer)):
        opt.zero_grad()
        (net.a(batch) + net.b(batch)).sum().backward()
        opt.step()
    for name, param in model.named_parameters():
        assert torch.equal(swapped.get_parameter(name), param), name


def test_optimizer_built_from_named_parameters_keeps_its_names_after_a_reordered_restore(
    tmp_path,
):
    """torch's own ``param_names`` (an optimizer given ``named_parameters()``) are put in the
    live order with the state they name, so they keep describing the live parameters."""
    model = _layers("a", "b")
    optimizer = torch.optim.Adam(model.named_parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(step=1).wait()
    swapped = _layers("b", "a")
    fresh = torch.optim.Adam(swapped.named_parameters())
    with Checkpointer(tmp_path, model=swapped, optimizer=fresh) as ckpt:
        assert ckpt.restore() == 1
    names = [name for name, _ in swapped.named_parameters()]
    assert fresh.state_dict()["param_groups"][0]["param_names"] == names
    assert torch.equal(
        fresh.state[swapped.a.weight]["exp_avg"], optimizer.state[model.a.weight]["exp_avg"]
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "young"}, r"policy= is the name 'young'.*pcframe\.policies\.create\('young'"),
        ({"model": {"w": torch.ones(1)}}, r"model= is a dict, which has no state_dict"),
        ({"scheduler": 0.1}, r"scheduler= is a float"),
        # saved at every version and never restored: restore updates a dict in place
        ({"extra": [0]}, r"extra= is a list: give a dict of JSON values"),
        ({"scaler": True}, r"scaler= is a bool, which has no state_dict"),
        ({"stateful": [torch.nn.Linear(1, 1)]}, r"stateful= is a list: give a dict of name"),
    ],
    ids=["policy-name", "dict-model", "number-scheduler", "list-extra", "bool-scaler",
         "list-stateful"],
)  # fmt: skip
def test_objects_that_are_not_what_they_should_be_are_refused_at_construction(
    tmp_path, kwargs, message
):
    """Each was accepted and failed at the first save or maybe_save with an AttributeError."""
    with pytest.raises(TypeError, match=message):
        Checkpointer(tmp_path, **kwargs)
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)):
        pass  # nothing was locked


@pytest.mark.parametrize("root", [None, 3])
def test_a_directory_that_is_not_a_path_is_named(root):
    with pytest.raises(TypeError, match=r"the checkpoint directory is a .*: give a path"):
        Checkpointer(root, model=torch.nn.Linear(2, 2))


def test_a_step_or_flag_of_the_wrong_type_is_named(tmp_path):
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt:
        with pytest.raises(TypeError, match=r"step='3': the training step is an int"):
            ckpt.maybe_save("3")
        ckpt.save(step=1).wait()
        with pytest.raises(TypeError, match=r"restore\(strict='no'\): give True or False"):
            ckpt.restore(strict="no")
        with pytest.raises(TypeError, match=r"restore\(allow_cast=1\)"):
            ckpt.restore(allow_cast=1)
        assert ckpt.restore() == 1


class _NeverLoads:
    """A stateful object whose load_state_dict() always raises, even for its own state."""

    def state_dict(self) -> dict:
        return {"n": 1}

    def load_state_dict(self, state: dict) -> None:
        raise RuntimeError("this object cannot load anything")


def test_a_rollback_that_fails_too_still_names_the_first_failure(tmp_path):
    """Before, the message named only the rollback's failure: the cause was in the log."""
    with Checkpointer(tmp_path, stateful={"odd": _NeverLoads()}) as ckpt:
        ckpt.save(step=1).wait()
        with pytest.raises(CheckpointError) as info:
            ckpt.restore()
    message = str(info.value)
    assert "loading stateful['odd'] failed (RuntimeError: this object" in message
    assert message.count("this object cannot load anything") == 2
    assert "rolling it back failed too: stateful['odd'] may be partly loaded" in message


def _nested(levels: int) -> dict:
    top = node = {}
    for _ in range(levels):
        node["a"] = node = {}
    return top


class _HugeCounter:
    def state_dict(self) -> dict:
        return {"seen": 10**5000}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_values_a_default_reader_cannot_parse_are_refused_before_the_version(tmp_path):
    """With the user's raised limits (sys.set_int_max_str_digits(0), a large recursion
    limit: both common in ML code) such a version committed, and the next process, with the
    default limits, set it aside as corrupt; with the default limits the save failed late
    (a raw RecursionError, or a commit-stage error whose advice led to the first case)."""
    model = torch.nn.Linear(2, 2)
    digits, recursion = sys.get_int_max_str_digits(), sys.getrecursionlimit()
    sys.set_int_max_str_digits(0)
    sys.setrecursionlimit(10_000)
    try:
        counter = {"counter": _HugeCounter()}
        seen = r"'/stateful/counter/seen': it has 16610 bits"
        with (
            Checkpointer(tmp_path, model=model, stateful=counter) as ckpt,
            pytest.raises(TypeError, match=seen),
        ):
            ckpt.save(step=1)
        with Checkpointer(tmp_path, model=model) as ckpt:
            with pytest.raises(TypeError, match=r"nested deeper than 64 levels"):
                ckpt.save(step=1, metadata={"cfg": _nested(1200)})
            with pytest.raises(TypeError, match=r"metadata\['n'\]': it has"):
                ckpt.save(step=1, metadata={"n": -(10**5000)})
            ckpt.save(step=2, metadata={"cfg": _nested(10), "n": 10**4000}).wait()
    finally:
        sys.set_int_max_str_digits(digits)
        sys.setrecursionlimit(recursion)
    with Checkpointer(tmp_path, model=model) as ckpt:  # the default limits: it reads back
        assert ckpt.restore() == 2 and ckpt.last_restore.version == 1


def test_paths_and_timeouts_no_call_can_use_are_refused_by_name(tmp_path, monkeypatch):
    """Checkpointer('') and pcframe.load('') used the working directory (and removed
    leftovers there); a 5000-character path was a raw ENAMETOOLONG; close(timeout='a') a
    raw TypeError from a comparison inside the wait."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "v00000001.tmp").mkdir()  # would be swept as a leftover of the cwd
    for path in ("", "x" * 5000, f"{tmp_path}/{'y' * 300}"):
        with pytest.raises(CheckpointError, match=r"empty path|too long a path"):
            Checkpointer(path, model=torch.nn.Linear(2, 2))
        with pytest.raises(CheckpointError, match=r"empty path|too long a path"):
            pcframe.load(path)
    assert (tmp_path / "v00000001.tmp").is_dir()
    with Checkpointer(tmp_path / "ckpt", model=torch.nn.Linear(2, 2)) as ckpt:
        handle = ckpt.save(step=1)
        with pytest.raises(TypeError, match=r"close\(timeout='a'\): give seconds"):
            ckpt.close(timeout="a")
        with pytest.raises(TypeError, match=r"SaveHandle.wait\(timeout='1'\)"):
            handle.wait(timeout="1")
        with pytest.raises(ValueError, match=r"wait\(timeout=nan\)"):
            ckpt.wait(timeout=float("nan"))
        assert handle.wait(timeout=30).value == "committed"
        ckpt.wait(timeout=np.int64(5))  # any real number of seconds is one


@pytest.mark.parametrize("reason", [123, b"epoch", ["a"]], ids=repr)
def test_a_reason_that_is_no_str_is_refused_naming_reason(tmp_path, reason):
    """save(reason=123) went ahead and stored whatever JSON made of it as the version's
    reason; it is refused in the caller, before any version is started."""
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt:
        with pytest.raises(TypeError, match=r"^reason=.* the save's reason is a str"):
            ckpt.save(1, reason=reason)
        assert ckpt.records == {}  # nothing started
        ckpt.save(1, reason="epoch end").wait()  # the engine goes on
    assert CheckpointDir(tmp_path).committed_versions() == [1]


class _CloseRaises(FixedSteps):
    """A user's policy whose own ``close()`` (Decisions.close calls it) raises."""

    def close(self) -> None:
        raise RuntimeError("the policy's close failed")


def test_a_policy_whose_close_raises_still_closes_the_sources_and_the_pipeline(tmp_path):
    """The policy's close() raising skipped the notice sources' close and the pipeline's:
    the engine's SIGTERM handler stayed installed after close() (SIGTERM no longer stopped
    the process) and its copy, writer and commit threads ran on. The policy's error is
    raised all the same, after everything is closed."""
    source = pcframe.policies.SignalNoticeSource()
    before = signal.getsignal(signal.SIGTERM)
    threads = set(threading.enumerate())
    ckpt = Checkpointer(
        tmp_path, model=torch.nn.Linear(2, 2), policy=_CloseRaises(2), notices=[source]
    )
    try:
        for step in range(1, 5):
            ckpt.maybe_save(step)
        with pytest.raises(RuntimeError, match="the policy's close failed"):
            ckpt.close()
        assert signal.getsignal(signal.SIGTERM) == before
        left = [t.name for t in set(threading.enumerate()) - threads if t.is_alive()]
        assert not [name for name in left if name.startswith("pcframe-")], left
    finally:
        source.close()
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as again:
        assert again.restore() == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": FixedSteps},  # the class: it has a decide, so it passed as a policy
        {"placement": pcframe.policies.SingleTier},
        {"placement": "single_tier"},
    ],
)
def test_a_policy_class_or_name_is_refused_when_the_engine_is_made(tmp_path, kwargs):
    """A class given as policy= passed the 'has a decide()' check and failed at the first
    maybe_save as "decide() missing 1 required positional argument"; a placement class or
    name failed as "'property' object is not subscriptable" or "'str' object has no
    attribute 'tiers'". Now a TypeError naming the argument, before the directory is
    locked."""
    (key,) = kwargs
    with pytest.raises(TypeError, match=f"{key}="):
        Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), **kwargs)
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)):  # nothing was left locked
        pass
