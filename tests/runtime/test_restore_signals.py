"""Signals during a restore: held while it commits, refused when their handler saves.

Real signals, sent to the main thread (``signal.pthread_kill``) by a reading thread at a
chosen point of the restore, handled by real handlers: Ctrl-C's ``default_int_handler``
and a handler that saves, as an emergency checkpoint on a preemption signal would.
"""

from __future__ import annotations

import errno
import logging
import signal
import threading
import time

import pytest
import torch

import pcframe.restore.reader as reader
import pcframe.save.persist as persist
from pcframe import Checkpointer
from pcframe.errors import CheckpointError
from pcframe.runtime.interrupts import interrupts_held
from pcframe.save.status import SaveStatus
from tests.helpers import disk_reads_only

SMALL = {"chunk_bytes": 64 << 10, "read_threads": 1}


def _objects(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 128)).sum().backward()
    optimizer.step()
    return model, optimizer


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    moments = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    return [t.clone() for t in [*model.state_dict().values(), *moments]]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def ctrl_c():
    """Ctrl-C raises KeyboardInterrupt in this process, whatever the test runner set."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _signal_after_first(monkeypatch, module, name: str, signum: int) -> list[int]:
    """Send ``signum`` to the main thread right after the first call of ``module.name``."""
    main, real, sent = threading.main_thread().ident, getattr(module, name), []

    def then_signal(*args, **kwargs):
        result = real(*args, **kwargs)
        if not sent:
            sent.append(signum)
            signal.pthread_kill(main, signum)
        return result

    monkeypatch.setattr(module, name, then_signal)
    return sent


def test_ctrl_c_while_a_fresh_process_fills_completes_the_restore_then_raises(
    tmp_path, monkeypatch, ctrl_c
):
    """No spare memory (nothing saved yet): the fill's second read is past the point of no
    return. Ctrl-C there used to leave the model restored, the optimizer not, and came out
    as a CheckpointError; now the restore completes, then KeyboardInterrupt is raised."""
    model, optimizer = _objects(0)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
    saved = _state(model, optimizer)
    model, optimizer = _objects(1)  # a new process's objects
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        sent = _signal_after_first(monkeypatch, reader, "preadv_all", signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            ckpt.restore()
        assert sent  # the fill did read a second time, and was interrupted there
        assert _same(_state(model, optimizer), saved)  # all of it restored, not half
        assert ckpt.last_restore.version == 1
        assert ckpt.feed.last_save_step == 1  # the policy was told training resumed


@pytest.mark.parametrize("call", ["save", "close", "decide"])
def test_an_engine_call_from_a_signal_handler_during_a_restore_is_refused(
    tmp_path, monkeypatch, call
):
    """A handler run in the middle of the restore's verifying read. A save there mixed old
    and restored tensors into a version (fresh process), or waited forever for the staging
    buffers the restore holds (a rollback); ``close()`` released the directory lock (and
    stopped the pipeline) while the restore still read and then applied; ``decide()`` sized
    the staging pool the restore had borrowed. Each is refused now, the restore fails
    changing nothing, the engine still owns its directory, and both work afterwards."""
    model, optimizer = _objects(0)
    disk_reads_only(monkeypatch)  # the verifying read is the disk's
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()  # its pool is idle now: the rollback borrows it
        model(torch.randn(4, 128)).sum().backward()
        optimizer.step()
        before = _state(model, optimizer)
        handler = {
            "save": lambda: ckpt.save(100).wait(),
            "close": ckpt.close,
            "decide": lambda: ckpt.decide(7),
        }[call]
        previous = signal.signal(signal.SIGUSR1, lambda *_: handler())
        try:
            # The first cold read of the verification: the restore has touched nothing yet.
            sent = _signal_after_first(monkeypatch, reader, "read_windows", signal.SIGUSR1)
            with pytest.raises(CheckpointError, match=rf"{call}\(\) was called while restore\(\)"):
                ckpt.restore()
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert sent
        assert _same(_state(model, optimizer), before)
        assert ckpt.committed_versions() == [1]  # no version of a half-restored state
        with pytest.raises(CheckpointError, match=r"locked|in use|another"):
            Checkpointer(tmp_path, model=model)  # the lock is still this engine's
        monkeypatch.undo()
        assert ckpt.restore() == 1
        assert ckpt.save(2).wait() is SaveStatus.COMMITTED


def test_a_signal_that_saves_during_the_commit_saves_the_restored_state_after_it(
    tmp_path, monkeypatch
):
    """Held while the restore commits, the handler runs once restore() has returned, not
    inside it: its save is allowed, and holds the restored state."""
    model, optimizer = _objects(0)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
    saved = _state(model, optimizer)
    model, optimizer = _objects(1)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        handles = []
        previous = signal.signal(signal.SIGUSR1, lambda *_: handles.append(ckpt.save(100)))
        try:
            sent = _signal_after_first(monkeypatch, reader, "preadv_all", signal.SIGUSR1)
            assert ckpt.restore() == 1
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert sent and len(handles) == 1
        handles[0].wait()
    fresh_model, fresh_optimizer = _objects(2)
    with Checkpointer(tmp_path, model=fresh_model, optimizer=fresh_optimizer) as ckpt:
        assert ckpt.restore() == 100
    assert _same(_state(fresh_model, fresh_optimizer), saved)  # the restored state, whole


def test_a_restore_from_a_signal_handler_during_a_save_is_refused(tmp_path, monkeypatch):
    """The other way round: a restore in the middle of a save's capture would write the
    tensors being captured, or wait for the slot the interrupted save holds."""
    from pcframe.save.capture import Capture

    model, optimizer = _objects(0)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
        previous = signal.signal(signal.SIGUSR1, lambda *_: ckpt.restore())
        try:
            _signal_after_first(monkeypatch, Capture, "request", signal.SIGUSR1)
            with pytest.raises(CheckpointError, match=r"restore\(\) was called while save\(\)"):
                ckpt.save(2)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        monkeypatch.undo()
        assert ckpt.save(3).wait() is SaveStatus.COMMITTED  # no slot was left taken
        assert ckpt.committed_versions() == [1, 2]  # the refused save took no number


def test_a_rollback_after_a_failed_save_restores_and_logs_the_failure(
    tmp_path, monkeypatch, caplog
):
    """The save failed in the background (a full disk); the job rolls back: the restore
    used to raise that save's error instead of restoring."""
    model, optimizer = _objects(0)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL) as ckpt:
        ckpt.save(1).wait()
        saved = _state(model, optimizer)

        def full(*_args):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(persist.os, "pwrite", full)
        handle = ckpt.save(2)  # fails on a writer thread
        while not handle.done():  # not waited for through the handle: nothing raised yet
            time.sleep(0.01)
        monkeypatch.undo()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        with caplog.at_level(logging.ERROR, logger="pcframe"):
            assert ckpt.restore() == 1
        assert _same(_state(model, optimizer), saved)
        assert "before the restore" in caplog.text and "no space left" in caplog.text


def test_held_signals_are_handled_after_the_block_in_the_order_they_came():
    seen: list[str] = []

    def record(n, _f):
        seen.append(signal.Signals(n).name)

    previous = {s: signal.signal(s, record) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        with interrupts_held():
            with interrupts_held():  # nested: holds nothing more, replays nothing early
                signal.raise_signal(signal.SIGUSR2)
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR2)
            assert seen == []
        assert seen == ["SIGUSR2", "SIGUSR1", "SIGUSR2"]
        assert all(signal.getsignal(s) is record for s in previous)  # put back
        signal.raise_signal(signal.SIGUSR1)  # handled at once again
        assert seen[-1] == "SIGUSR1" and len(seen) == 4
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_restore_off_the_main_thread_holds_nothing():
    """Only the main thread runs handlers and may change them: elsewhere it is a no-op."""
    handler = signal.getsignal(signal.SIGINT)
    inside: list[object] = []

    def work() -> None:
        with interrupts_held():
            inside.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert inside == [handler]


def test_a_replayed_handler_that_raises_leaves_the_later_signals_pending():
    seen: list[str] = []

    def fails(_n, _f):
        raise RuntimeError("handler failed")

    previous = {
        signal.SIGUSR1: signal.signal(signal.SIGUSR1, fails),
        signal.SIGUSR2: signal.signal(signal.SIGUSR2, lambda n, _f: seen.append("SIGUSR2")),
    }
    try:
        with pytest.raises(RuntimeError, match="handler failed"), interrupts_held():
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:  # sent again: handled soon after
            time.sleep(0.01)
        assert seen == ["SIGUSR2"]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_put_back_cut_short_by_a_signal_leaves_every_signal_handled(monkeypatch):
    """Python runs a handler between any two bytecodes: Ctrl-C raised in the middle of
    putting the handlers back left the rest holding signals for good, and every later
    restore holding nothing. A released hold now passes each signal on to its handler."""
    import pcframe.runtime.interrupts as interrupts

    seen: list[str] = []

    def record(n, _f):
        seen.append(signal.Signals(n).name)

    previous = {s: signal.signal(s, record) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    real, raised = signal.signal, []

    def interrupted_once(signum, handler):
        if handler is record and not raised:
            raised.append(signum)
            raise KeyboardInterrupt  # as Ctrl-C's handler would, between two bytecodes
        return real(signum, handler)

    try:
        with pytest.raises(KeyboardInterrupt), interrupts.interrupts_held():
            signal.raise_signal(signal.SIGUSR2)  # held
            monkeypatch.setattr(interrupts.signal, "signal", interrupted_once)
        monkeypatch.undo()
        assert raised and seen == ["SIGUSR2"]  # the held one was still handled
        assert not interrupts._holding  # the next hold holds again
        for s in previous:  # each reaches its handler, put back or passed on
            signal.raise_signal(s)
        assert seen[1:] == ["SIGUSR1", "SIGUSR2"]
        with interrupts.interrupts_held():
            signal.raise_signal(signal.SIGUSR1)
            assert seen[-1] == "SIGUSR2"  # held again
        assert seen[-1] == "SIGUSR1"
        assert all(signal.getsignal(s) is record for s in previous)  # looked through
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_hold_whose_outer_end_was_cut_short_is_released_by_the_next_one():
    import pcframe.runtime.interrupts as interrupts

    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda n, _f: seen.append(n))
    try:
        outer = interrupts.held_to_the_end()
        outer.__enter__()
        with interrupts.interrupts_held():
            signal.raise_signal(signal.SIGUSR1)
        assert seen == []  # held to the end of the outer block
        interrupts._to_the_end = False  # its exit began, and was cut short there
        with interrupts.interrupts_held():  # releases the stale hold first
            pass
        assert seen == [signal.SIGUSR1]
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, previous)
