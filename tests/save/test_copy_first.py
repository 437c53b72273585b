"""While the training thread waits for a snapshot, the copy goes first.

The waiting training thread stages chunks itself (in parallel with the copy thread) and the
writers hold off until the copy no longer needs the CPU or a buffer back; the bytes written
are the same either way.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pcframe import Checkpointer
from pcframe.save.fill import Filler
from pcframe.save.staging import StagingPool
from pcframe.save.status import SaveStatus

CHUNK = 64 * 1024


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 128)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_the_waiting_training_thread_stages_chunks_and_the_bytes_are_exact(tmp_path, monkeypatch):
    model, optimizer = _state()
    fillers: list[str] = []
    original = Filler.chunk  # every chunk, whichever kernel copies it
    helped = threading.Event()  # the training thread staged a chunk

    def held_fill(self, write, chunk, buffer, flats):
        fillers.append(threading.current_thread().name)
        if threading.current_thread() is threading.main_thread():
            helped.set()
        elif not helped.wait(30):
            # The copy thread holds its chunk until the training thread, waiting in the gate,
            # has staged one: the copy is still running when it gets there, however late (10
            # ms a chunk did not make sure of that on a loaded machine). Not forever.
            helped.set()
        return original(self, write, chunk, buffer, flats)

    monkeypatch.setattr(Filler, "chunk", held_fill)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, chunk_bytes=CHUNK) as ckpt:
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.save(1)
        optimizer.step()  # the gate: waits, and helps
        ckpt.wait()
    assert threading.main_thread().name in fillers
    assert "pcframe-copy" in fillers
    fresh = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)])
    with Checkpointer(tmp_path, model=fresh) as ckpt:
        ckpt.restore(strict=False)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())


def _pool(buffers: int) -> StagingPool:
    pool = StagingPool(4096)
    pool.ensure(buffers * 4096, pinned=False)
    return pool


def _turn_taken(pool: StagingPool, within: float) -> bool:
    done = threading.Event()
    threading.Thread(target=lambda: (pool.writer_turn(), done.set()), daemon=True).start()
    return done.wait(within)


def test_writers_hold_off_while_training_waits_and_buffers_are_free():
    pool = _pool(3)
    buffer = pool.acquire()
    assert _turn_taken(pool, 30)  # nobody waits: writers go
    with pool.training_waits():
        assert not _turn_taken(pool, 0.2)  # the copy has free buffers: writers hold
    pool.release(buffer)


def test_writers_go_when_the_copy_needs_a_buffer_back():
    pool = _pool(2)
    with pool.training_waits():
        first = pool.acquire()
        done = threading.Event()
        threading.Thread(target=lambda: (pool.writer_turn(), done.set()), daemon=True).start()
        assert not done.wait(0.2)
        # The last free buffer: the copy fills it without help, writers still hold (letting
        # them start here cost 1-5 ms of stall while the last chunk was copied).
        second = pool.acquire()
        assert not done.wait(0.2)
        third: list = []
        threading.Thread(target=lambda: third.append(pool.acquire()), daemon=True).start()
        # The copy now waits for a buffer: a writer must free one. (Bounds of 30 s, not 1 s:
        # each is reached at once unless the machine is loaded.)
        assert done.wait(30)
        pool.release(first)
        deadline = time.monotonic() + 30
        while not third and time.monotonic() < deadline:
            time.sleep(0.01)
        assert third, "the waiting copy got the freed buffer"
    pool.release(second)
    pool.release(third[0])


def test_a_held_writer_goes_once_training_stops_waiting():
    pool = _pool(2)
    done = threading.Event()
    with pool.training_waits():
        threading.Thread(target=lambda: (pool.writer_turn(), done.set()), daemon=True).start()
        assert not done.wait(0.2)
    assert done.wait(30)


def test_an_interrupt_while_helping_leaves_the_version_to_the_copy_thread(tmp_path, monkeypatch):
    model, optimizer = _state()
    original = Filler.chunk
    interrupted = []

    def fill(self, write, chunk, buffer, flats):
        if threading.current_thread() is threading.main_thread() and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt  # Ctrl-C (or a signal handler raising) mid-chunk
        time.sleep(0.005)
        return original(self, write, chunk, buffer, flats)

    monkeypatch.setattr(Filler, "chunk", fill)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, chunk_bytes=CHUNK) as ckpt:
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        handle = ckpt.save(1)
        with pytest.raises(KeyboardInterrupt):
            optimizer.step()  # the gate helps, is interrupted: the step is, not the version
        assert handle.wait() == "committed"
    assert interrupted
    fresh = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)])
    with Checkpointer(tmp_path, model=fresh) as ckpt:
        ckpt.restore(strict=False)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())


def test_a_refused_pool_resize_leaves_the_engine_usable(tmp_path, monkeypatch):
    from pcframe.errors import SaveError

    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.Adam(model.parameters())
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(0).wait()  # no Adam state yet: a small pool
        model(torch.randn(2, 256)).sum().backward()
        optimizer.step()
        real = StagingPool._allocate
        monkeypatch.setattr(
            StagingPool,
            "_allocate",
            lambda self, count, pinned: (_ for _ in ()).throw(MemoryError("refused")),
        )
        with pytest.raises(SaveError, match="cannot allocate a staging pool"):
            ckpt.save(1)  # the bigger pool is refused
        monkeypatch.setattr(StagingPool, "_allocate", real)
        optimizer.state.clear()  # small again (an optimizer reset)
        assert ckpt.save(2).wait(timeout=30) == "committed"


def test_a_refused_resize_fails_the_next_copy_instead_of_hanging(monkeypatch):
    pool = _pool(1)
    monkeypatch.setattr(
        StagingPool, "_allocate", lambda self, count, pinned: (_ for _ in ()).throw(MemoryError())
    )
    with pytest.raises(MemoryError, match="cannot allocate a staging pool"):
        pool.ensure(4 * 4096, pinned=False)  # no buffer out: the old pool is freed first
    # A version queued before that save copies now: there is no buffer to wait for.
    failed: list[BaseException] = []
    waiter = threading.Thread(target=lambda: _record(failed, pool.acquire), daemon=True)
    waiter.start()
    waiter.join(2.0)
    assert not waiter.is_alive() and isinstance(failed[0], RuntimeError)


def _record(into: list, call) -> None:
    try:
        call()
    except BaseException as exc:
        into.append(exc)


def test_an_interrupt_at_any_line_of_acquire_leaves_writers_held_next_time():
    """Ctrl-C (a signal handler raising) can land between two bytecodes of the training
    thread's ``acquire``: wherever it hits the waiting part (the ``try`` and its ``finally``),
    writers are held again once that thread next takes a buffer. (An interrupt exactly at a
    ``with`` statement's edges can leave any Python lock held: a CPython limitation.)"""
    import inspect
    import sys

    source, first = inspect.getsourcelines(StagingPool.acquire)
    body = [text.strip() for text in source]
    start, end = body.index("try:"), body.index("finally:")
    # The body of the try and of the finally. (Not the `try:` line itself: in CPython 3.11 a
    # tracer raising there, where no signal is ever delivered, escapes the `with` too.)
    lines = [first + i for i in range(start + 1, end + 2) if i != end]
    for target in lines:
        pool = _pool(1)
        held = pool.acquire()  # no free buffer: the next acquire waits
        released = threading.Event()
        hit: list[int] = []

        def tracer(frame, event, arg, target=target, hit=hit):
            if frame.f_code is StagingPool.acquire.__code__:
                if event == "line" and frame.f_lineno == target and not hit:
                    hit.append(target)
                    raise KeyboardInterrupt
                return tracer
            return None

        def interrupted_then_next(pool=pool, released=released):
            sys.settrace(tracer)
            try:
                pool.acquire()
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            released.wait(2.0)
            pool.release(pool.acquire())  # the same thread's next buffer

        thread = threading.Thread(target=interrupted_then_next, daemon=True)
        thread.start()
        time.sleep(0.05)
        pool.release(held)
        released.set()
        thread.join(2.0)
        assert not thread.is_alive() and hit == [target]
        taken = pool.acquire()  # nothing free again
        with pool.training_waits():
            assert not _turn_taken(pool, 0.2), f"an interrupt at line {target} freed writers"
        pool.release(taken)


@pytest.mark.parametrize("tensors", [True, False], ids=["state", "no-tensors"])
def test_the_snapshot_does_not_wait_for_its_files(tmp_path, monkeypatch, tensors):
    """Creating and reserving the data file (milliseconds for a large state) runs beside the
    copy: the optimizer step goes on while it is still blocked, and the version commits
    once it is done (with no chunk to write, too: the commit itself waits for the files)."""
    import pcframe.save.opening as opening

    model, optimizer = _state()
    release, entered = threading.Event(), threading.Event()
    original = opening.open_data_file

    def slow_open(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return original(*args, **kwargs)

    monkeypatch.setattr(opening, "open_data_file", slow_open)
    objects = {"model": model, "optimizer": optimizer} if tensors else {"extra": {"a": 1}}
    with Checkpointer(tmp_path, chunk_bytes=CHUNK, **objects) as ckpt:
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        handle = ckpt.save(1)
        try:
            assert entered.wait(10)
            stepped = threading.Event()
            waiter = threading.Thread(target=lambda: (ckpt.wait_for_snapshot(), stepped.set()))
            waiter.start()
            assert stepped.wait(5), "the snapshot waited for its files to be created"
            waiter.join()
            assert not handle.done()  # not committed without its file
        finally:
            release.set()
        assert handle.wait(10) is SaveStatus.COMMITTED
    fresh = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)])
    with Checkpointer(tmp_path, model=fresh) as ckpt:
        ckpt.restore(strict=False)
    if tensors:
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())


def test_the_time_spent_creating_the_files_is_charged_to_the_version(tmp_path, monkeypatch):
    """The opener's CPU time (mkdir, posix_fallocate: kernel time) is in the version's cost."""
    import pcframe.save.opening as opening

    model, optimizer = _state()
    original = opening.open_data_file

    def busy_open(*args, **kwargs):
        start = time.thread_time()
        while time.thread_time() - start < 0.2:  # CPU time, as the file system would take
            pass
        return original(*args, **kwargs)

    monkeypatch.setattr(opening, "open_data_file", busy_open)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(1)
        ckpt.wait()  # reports the finished version into its record
        assert ckpt.records[1].cpu >= 0.2
