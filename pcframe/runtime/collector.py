"""Python's cyclic garbage collector held off while a restore builds and drops its objects.

A restore parses a manifest, plans a read and loads state dicts: tens of thousands of
short-lived containers for a state of thousands of tensors. CPython counts every tracked
allocation, and each 700 of them start a collection of the youngest objects, which moves
the ones still alive (this restore's own, held for a moment) into the older generations,
until a full collection walks every object of the process. With a model, its optimizer
and torch imported that is some 300,000 objects: one in three restores of a 3200-tensor
state here took 135 ms more (355 ms against 220 ms), all of it in full collections.

While :func:`collector_paused` holds, nothing is collected; the restore's containers are
freed by their reference counts when it ends (each free takes its allocation off the
count again), so the work is avoided, not postponed. Reference cycles made meanwhile wait
for the next collection after it, except after a failed attempt: an exception's traceback
holds the frames that read it, and so the attempt's fresh tensors, in a cycle, which
:func:`collect_if_paused` frees before the next attempt reads another copy of the state.
Nested and concurrent holders are counted: the collector is re-enabled when the last one
leaves, and only if a pause turned it off (a program running without it keeps it off; one
that turns it off while another thread holds a pause gets it back when that pause ends).
The debt is recorded before the collector is turned off and cleared only after it is
turned back on, and a holder is counted inside the block that uncounts it, so an
exception raised between two bytecodes (a signal handler) leaves it off at worst until
the next pause ends, except in the few bytecodes before a holder's exit takes the lock.
A child forked during a pause starts with no holder and the collector as it was before.

:func:`current_frames` (other threads' stacks) holds a pause for another reason: a CPython
3.11 deadlock (its docstring).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections.abc import Iterator
from types import FrameType

# Re-entrant: a signal handler that saves runs on the thread that may hold it.
_lock = threading.RLock()
_holders = 0
_owed = False  # a pause turned the collector off and owes turning it back on


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (reference counting goes on)."""
    global _holders, _owed
    try:  # counted inside: an interruption before the count only lowers it, never leaks one
        with _lock:
            if _holders == 0 and not _owed and gc.isenabled():
                _owed = True  # first: an interruption after it leaves a debt, paid next time
                gc.disable()
            _holders += 1
        yield
    finally:
        with _lock:
            _holders = max(0, _holders - 1)  # a forked child that inherited this block: 0
            if _holders == 0 and _owed:
                gc.enable()
                _owed = False  # last: an interruption before it only re-enables again


def collect_if_paused() -> None:
    """After a failed attempt inside a pause: collect now, so that the cycle its exception
    left (the attempt's tensors among it) does not hold a second copy of the state while
    the next attempt reads. Nothing outside a pause (the collector runs there anyway)."""
    if _holders and _owed:
        gc.collect()


def _forget_holders_after_fork() -> None:
    # The child has only the forking thread: the other holders do not exist there, and the
    # lock may have been held by one of them. The collector as it was before the pause.
    global _lock, _holders, _owed
    if _holders and _owed:
        gc.enable()
    _lock, _holders, _owed = threading.RLock(), 0, False


os.register_at_fork(after_in_child=_forget_holders_after_fork)


def current_frames() -> dict[int, FrameType]:
    """``sys._current_frames()`` with the collector paused.

    CPython 3.11 holds its thread-list lock while it builds the result, and the objects it
    makes can set off a collection on this thread; a ``threading.local`` freed there takes
    that lock again and the process hangs for good (every thread start and exit waits for
    the lock too). Seen as a main thread stuck in ``Thread.start()``.
    """
    with collector_paused():
        return sys._current_frames()
