"""An exception inside save() must not hang close(), and bad knobs fail at construction."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap

import pytest
import torch

from pcframe import Checkpointer, ConfigError, EngineConfig, SaveError
from pcframe.errors import CheckpointError
from pcframe.save.status import SaveStatus
from pcframe.store.directory import CheckpointDir


def test_unallocatable_staging_pool_fails_save_and_close_returns(tmp_path):
    model = torch.nn.Linear(8, 8)
    with Checkpointer(tmp_path, model=model, keep_last=2) as ckpt:
        ckpt.save(1).wait()
        ckpt.config.staging_bytes = 1 << 50  # as if configured: a petabyte of staging
        # A save that failed for want of memory (SaveError: training may go on), not a
        # setting that is out of range (ConfigError): the same knobs worked until now.
        with pytest.raises(SaveError, match="cannot allocate a staging pool") as failed:
            ckpt.save(2)
        assert not isinstance(failed.value, ConfigError) and failed.value.stage == "snapshot"
        assert "last committed checkpoint is intact" in str(failed.value)
        ckpt.wait(timeout=10)  # its slot was given back, and it is not raised again
        ckpt.config.staging_bytes = 1 << 20  # memory back: the next save allocates and commits
        ckpt.save(3).wait()
    assert CheckpointDir(tmp_path).committed_versions() == [1, 3]


@pytest.mark.parametrize(
    "overrides",
    [
        {"staging_bytes": 1 << 50},
        {"chunk_bytes": 8192.0},
        {"staging_ratio": float("nan")},
    ],
)
def test_a_process_whose_save_raised_exits_promptly(tmp_path, overrides):
    """The reported hang: save() raised, then with-exit / atexit blocked forever."""
    script = textwrap.dedent(
        f"""
        import sys, torch
        from pcframe import Checkpointer
        ckpt = Checkpointer(sys.argv[1], model=torch.nn.Linear(8, 8))
        try:
            ckpt.config.__dict__.update({overrides!r})
            ckpt.save(1)
        except Exception as exc:
            print("raised", type(exc).__name__)
        # no close(): atexit must finish the engine without hanging
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # Raised by save() itself, or by the background stage and reported at exit: never a hang.
    assert "raised" in done.stdout or "failed in stage" in done.stderr, done


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("keep_last", 1.5),
        ("max_in_flight", 2.5),
        ("max_in_flight", "2"),
        ("chunk_bytes", 8192.0),
        ("staging_ratio", float("nan")),
        ("staging_ratio", float("inf")),
        ("staging_bytes", True),
        ("writer_threads", None),
        ("o_direct", 1),
        ("keep_last", 0),
    ],
)
def test_every_engine_knob_is_type_and_range_checked(key, value):
    with pytest.raises(ConfigError, match=f"engine.{key}="):
        EngineConfig(**{key: value})


def test_a_misspelt_engine_option_names_the_nearest_one_and_locks_nothing(tmp_path):
    with pytest.raises(TypeError, match=r"\['max_in_fligt'\].*did you mean 'max_in_flight'"):
        Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), max_in_fligt=2)
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), max_in_flight=1) as ckpt:
        assert ckpt.config.max_in_flight == 1  # the directory was never locked
    with pytest.raises(ConfigError, match=r"engine\.max_in_flight="):
        EngineConfig().with_overrides(max_in_flight=0)  # overrides are range-checked too


def test_close_with_a_timeout_names_the_versions_in_flight(tmp_path, monkeypatch):
    import threading

    from pcframe.save.write import Writer

    release, written = threading.Event(), threading.Event()
    original = Writer.write_chunk

    def stuck(self, *args):
        release.wait(30)
        original(self, *args)
        written.set()

    monkeypatch.setattr(Writer, "write_chunk", stuck)
    model = torch.nn.Linear(8, 8)
    ckpt = Checkpointer(tmp_path, model=model)
    ckpt.save(1)
    with pytest.raises(Exception, match=r"still in flight after 0 s"):
        ckpt.close(timeout=0.2)
    # Returned with the write still held (not after it, as a wall-clock bound had it).
    assert not written.is_set()
    release.set()
    ckpt.close()
    assert CheckpointDir(tmp_path).committed_versions() == [1]


def test_two_saves_that_fail_together_are_each_raised_once(tmp_path, monkeypatch):
    """Both failures were handed over in one batch: the first was raised and the second
    never was (each engine call raises one; the next one raises the next)."""
    import errno
    import time

    import pcframe.save.persist as persist

    def full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    model = torch.nn.Linear(64, 64)
    with Checkpointer(tmp_path, model=model, max_in_flight=2) as ckpt:
        ckpt.save(1).wait()
        monkeypatch.setattr(persist.os, "pwrite", full)
        handles = [ckpt.save(2), ckpt.save(3)]
        while not all(h.done() for h in handles):  # both finished, neither raised yet
            time.sleep(0.01)
        monkeypatch.undo()
        raised = []
        for _ in range(2):
            with pytest.raises(SaveError) as failed:
                ckpt.wait()
            raised.append(failed.value.version)
        assert sorted(raised) == [2, 3]
        ckpt.wait()  # each was raised once
        ckpt.save(4).wait()
    assert CheckpointDir(tmp_path).committed_versions() == [1, 4]


@pytest.mark.parametrize("where", ["after the capture", "in the hand-off"])
def test_an_interrupt_while_a_save_starts_gives_its_slot_back(tmp_path, monkeypatch, where):
    """Ctrl-C between the capture and the pipeline taking the version: the slot was never
    given back (after the capture), so with one in flight the next save waited forever;
    in the hand-off the version is finished as failed, so close() does not wait for it."""
    import pcframe.save.flight as flight

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(tmp_path, model=model, optimizer=opt, max_in_flight=1)
    try:
        if where == "after the capture":
            real = flight.SaveProgress

            def interrupted(*args, **kwargs):
                monkeypatch.setattr(flight, "SaveProgress", real)
                raise KeyboardInterrupt

            monkeypatch.setattr(flight, "SaveProgress", interrupted)
        else:
            real_submit = ckpt._pipeline.submit

            def interrupted(request, progress):
                monkeypatch.setattr(ckpt._pipeline, "submit", real_submit)
                raise KeyboardInterrupt

            monkeypatch.setattr(ckpt._pipeline, "submit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(1)
        assert ckpt._flight.wait_all(timeout=5)  # every slot free
        assert ckpt.save(2).wait() is SaveStatus.COMMITTED
    finally:  # a leaked slot would make a plain close() wait forever
        with contextlib.suppress(CheckpointError):
            ckpt.close(timeout=5)
    # A version the pipeline never took keeps its number free; one abandoned in the hand-off
    # used it (recorded as failed).
    expected = [1] if where == "after the capture" else [2]
    assert CheckpointDir(tmp_path).committed_versions() == expected


def _on_stack(thread_id: int, function: str) -> bool:
    frame = sys._current_frames().get(thread_id)
    while frame is not None and frame.f_code.co_name != function:
        frame = frame.f_back
    return frame is not None


def test_wait_raises_a_failure_the_commit_thread_is_still_handing_over(tmp_path, monkeypatch):
    """The commit thread set a version's ``finished`` before handing it over to the training
    thread: a wait() in between saw every version finished, found none handed over and
    returned without raising the failure (it came one call later). Here wait() is called
    while the hand-over is held, and the hand-over goes on once wait() waits: that wait()
    raises the failure."""
    import errno
    import threading
    import time

    import pcframe.save.persist as persist
    from pcframe.save.flight import InFlight

    handing = threading.Event()  # the commit thread is handing version 1 over
    waits = threading.Event()  # the training thread waits in ckpt.wait()
    hand_over = InFlight.finished

    def held(self: InFlight, progress) -> None:  # the commit thread's hand-over
        handing.set()
        waits.wait(30)
        hand_over(self, progress)

    def full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    main = threading.get_ident()

    def see_the_wait() -> None:  # an observable condition, not a delay
        deadline = time.monotonic() + 30
        while not (_on_stack(main, "_wait_all") and _on_stack(main, "wait_until")):
            if waits.is_set() or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        waits.set()

    monkeypatch.setattr(InFlight, "finished", held)  # before the engine binds it
    ckpt = Checkpointer(tmp_path, model=torch.nn.Linear(64, 64))
    try:
        monkeypatch.setattr(persist.os, "pwrite", full)
        handle = ckpt.save(1)  # copied when it returns; its writes fail
        assert handing.wait(30), "version 1 never finished"
        watcher = threading.Thread(target=see_the_wait, daemon=True)
        watcher.start()
        with pytest.raises(SaveError, match=r"version 1 \(step 1\) failed in stage 'persist'"):
            ckpt.wait()
        assert handle.status is SaveStatus.FAILED
        ckpt.wait()  # raised once
    finally:
        waits.set()
        monkeypatch.undo()
        ckpt.close(timeout=30)
    assert CheckpointDir(tmp_path).committed_versions() == []
