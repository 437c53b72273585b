"""Interrupts held while a restore commits: from the first byte it cannot take back.

A restore changes nothing until it commits. It verifies every byte first, and the live
bytes it reads straight over are kept aside until it holds (:mod:`pcframe.restore.backup`).
Where no spare memory was lent (a process that has not saved yet: the usual resume), the
commit reads the verified bytes a second time into the live tensors (the fill), and from
its first byte the old values are gone. An interrupt there (Ctrl-C, or a signal handler
that raises or exits) left the model restored and the optimizer not, and was reported as a
failed restore, the interrupt itself lost.

So while a restore commits (:func:`interrupts_held`), every signal whose handler is a
Python function (``KeyboardInterrupt``'s included) is recorded instead, and handled once
the restore is complete: the handlers run in the order the signals came; if one raises,
the signals after it are sent again (pending, as the OS keeps them) and its exception is
raised. Inside :func:`held_to_the_end` (a ``Checkpointer.restore`` call) the handlers run
when that call ends, so a held handler that saves finds the restore over, not running.

The commit is usually short (a read from the page cache and the objects'
``load_state_dict``; a state larger than the free page cache is read from the disk
again): Ctrl-C waits for it. The verifying read, most of a restore, still stops at once and
changes nothing; SIGKILL, and signals without a Python handler, end the process as always.
Swapping the Python handlers resets what a C library set on top of them for those signals
(``faulthandler.register(..., chain=True)``, ``signal.siginterrupt``).

Only the main thread runs signal handlers and may change them: a restore on another thread
is not interrupted by them, and holds nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

Handlers = dict[int, Any]
Caught = list[tuple[int, FrameType | None]]

_holding = False  # the main thread's signals are held now (nested holds add nothing)
_to_the_end = False  # inside held_to_the_end: a hold's end waits for it
_deferred: list[tuple[Handlers, Caught]] = []  # a hold that ended inside held_to_the_end


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold the signals with Python handlers until the block ends, then handle them."""
    global _holding
    if _holding or not _on_main_thread():
        yield
        return
    handlers: Handlers = {}
    caught: Caught = []

    def hold(signum: int, frame: FrameType | None) -> None:
        caught.append((signum, frame))

    _holding = True
    try:
        for signum in signal.valid_signals():
            handler = signal.getsignal(signum)
            if callable(handler):  # SIG_DFL and SIG_IGN are not: the OS acts on those
                handlers[signum] = handler
                signal.signal(signum, hold)
        yield
    finally:
        if _to_the_end:
            _deferred.append((handlers, caught))  # still held: held_to_the_end handles them
        else:
            _handle(handlers, caught)


@contextlib.contextmanager
def held_to_the_end() -> Iterator[None]:
    """Signals held by :func:`interrupts_held` inside this block stay held until it ends."""
    global _to_the_end
    if _to_the_end or not _on_main_thread():
        yield
        return
    _to_the_end = True
    try:
        yield
    finally:
        _to_the_end = False
        while _deferred:
            _handle(*_deferred.pop())


def _handle(handlers: Handlers, caught: Caught) -> None:
    """Put the handlers back, then run them for the signals caught meanwhile."""
    global _holding
    interrupted: BaseException | None = None
    for signum, handler in handlers.items():
        while True:  # a signal that comes now runs its pending handler inside signal.signal
            try:
                signal.signal(signum, handler)
                break
            except BaseException as exc:  # each handler must go back: try it again
                interrupted = interrupted or exc
    _holding = False
    for index, (signum, frame) in enumerate(caught):
        try:
            handlers[signum](signum, frame)
        except BaseException:
            for later, _ in caught[index + 1 :]:  # pending again, as the OS would keep them
                os.kill(os.getpid(), later)
            raise
    if interrupted is not None:
        raise interrupted
