"""The cyclic collector is held off while any holder is inside and restored as it was."""

from __future__ import annotations

import gc
import threading

import pytest

from pcframe.runtime.collector import collector_paused


def test_nested_holders_give_it_back_when_the_last_leaves():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_exception_gives_it_back():
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_holder_in_another_thread_keeps_it_off_until_it_leaves():
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with collector_paused():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert inside.wait(10)
    with collector_paused():
        pass
    assert not gc.isenabled()  # the other holder is still inside
    leave.set()
    thread.join(10)
    assert gc.isenabled()


def test_it_stays_off_for_a_program_that_turned_it_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_child_forked_inside_a_pause_starts_with_it_as_before():
    import os

    with collector_paused():
        pid = os.fork()
        if pid == 0:  # the child: no holder of its own, the collector as before the pause
            fine = gc.isenabled()
            with collector_paused():
                fine = fine and not gc.isenabled()
            os._exit(0 if fine and gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()


def test_a_save_captures_with_it_held_off_and_gives_it_back(tmp_path):
    import torch

    from pcframe import Checkpointer

    seen = []

    class Probe:
        def state_dict(self):
            seen.append(gc.isenabled())
            return {"x": 1}

        def load_state_dict(self, state):
            pass

    model = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path, model=model, stateful={"probe": Probe()}) as ckpt:
        ckpt.save(1).wait()
        assert seen == [False] and gc.isenabled()


def test_other_threads_stacks_are_read_while_thread_locals_are_collected():
    """CPython 3.11: ``sys._current_frames()`` holds the thread-list lock while it builds its
    result; a collection it sets off there that frees a ``threading.local`` takes the lock
    again, and the process hangs for good (a thread made such garbage in a loop: hung within
    seconds here). ``current_frames`` reads the stacks with the collector paused."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import gc, threading, time
        from pcframe.runtime.collector import current_frames

        gc.set_threshold(50)  # a collection every few allocations

        class Holder:
            def __init__(self):
                self.local = threading.local()
                self.local.value = 1
                self.me = self  # a cycle: only the collector frees it

        done = threading.Event()
        def litter():
            while not done.is_set():
                Holder()

        threading.Thread(target=litter, daemon=True).start()
        end, calls = time.monotonic() + 3, 0
        while time.monotonic() < end:
            assert threading.main_thread().ident in current_frames()
            calls += 1
        done.set()
        assert gc.isenabled()
        print("calls", calls)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("calls"), done.stderr
