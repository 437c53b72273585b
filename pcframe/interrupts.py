"""Interrupts held while a restore commits: from the first byte it cannot take back.

A restore changes nothing until it commits. It verifies every byte first, and the live
bytes it reads straight over are kept aside until it holds (:mod:`pcframe.restore.backup`).
Where no spare memory was lent (a process that has not saved yet: the usual resume), the
commit reads the verified bytes a second time into the live tensors (the fill), and from
its first byte the old values are gone. An interrupt there (Ctrl-C, or a signal handler
that raises or exits) left the model restored and the optimizer not, and was reported as a
failed restore, the interrupt itself lost.

So while a restore commits (:func:`interrupts_held`), every signal whose handler is a
Python function (``KeyboardInterrupt``'s included) is recorded instead, and handled, in
the order the signals came, once the commit is over: the restore completes, then the
interrupt is raised. The commit is short (a read from the page cache and the objects'
``load_state_dict``), so Ctrl-C still stops the long verifying read at once, and that
leaves everything as it was.

Only the main thread runs signal handlers and may change them: a restore on another
thread is not interrupted by them, and holds nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

_holding = False  # the main thread is inside interrupts_held (nested calls hold nothing more)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold the signals with Python handlers until the block ends, then handle them."""
    global _holding
    if _holding or threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, FrameType | None]] = []
    handlers: dict[int, Any] = {}

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
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        _holding = False
        for signum, frame in caught:  # each as it would have been handled, in order
            handlers[signum](signum, frame)
