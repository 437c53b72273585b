"""Interrupts held while a restore commits: from the first byte it cannot take back.

A restore changes nothing until it commits. It verifies every byte first, and the live
bytes it reads straight over are kept aside until it holds (:mod:`pcframe.restore.live`).
Where no spare memory was lent (a process that has not saved yet: the usual resume), the
commit reads the verified bytes a second time into the live tensors (the fill), and from
its first byte the old values are gone. An interrupt there (Ctrl-C, or a signal handler
that raises or exits) left the model restored and the optimizer not, and was reported as a
failed restore, the interrupt itself lost.

So while a restore commits (:func:`interrupts_held`), every signal whose handler is a
Python function (``KeyboardInterrupt``'s included) is recorded instead, by a
:class:`_Hold` put in the handler's place, and handled once the restore is complete: the
handlers run in the order the signals came; if one raises, the signals after it are sent
again (pending, as the OS keeps them) and its exception is raised. Inside
:class:`held_to_the_end` (a ``Checkpointer.restore`` call) they run when that call ends,
so a held handler that saves finds the restore over, not running.

Python runs a signal's handler between any two bytecodes of the main thread, so the
release cannot be made atomic; it is made harmless to cut short instead. A released
``_Hold`` passes each signal on to the handler it replaced, so one left in place by an
interrupted put-back behaves as that handler (``signal.getsignal`` shows the ``_Hold``, and
the next hold looks through it); the flags are plain stores, set before anything that can
be interrupted; a hold whose end was cut short is released by the next one.

The commit is usually short (a read from the page cache and the objects'
``load_state_dict``; a state larger than the free page cache is read from the disk
again): Ctrl-C waits for it. The verifying read, most of a restore, still stops at once and
changes nothing; SIGKILL, and signals without a Python handler, end the process as always.
Replacing the Python handlers resets what a C library set on top of them for those signals
(``faulthandler.register(..., chain=True)``, ``signal.siginterrupt``).

Only the main thread runs signal handlers and may change them: a restore on another thread
is not interrupted by them, and holds nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


class _Hold:
    """In place of each held signal's handler: records the signal while ``held``, then
    passes it on to the handler it replaced."""

    def __init__(self) -> None:
        self.held = True
        self.handlers: dict[int, Any] = {}  # signal -> the handler this replaced
        self.caught: list[tuple[int, FrameType | None]] = []

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        if self.held:
            self.caught.append((signum, frame))
            return None
        return self.handlers[signum](signum, frame)

    def install(self) -> None:
        for signum in signal.valid_signals():
            handler = signal.getsignal(signum)
            while isinstance(handler, _Hold) and not handler.held:  # one a cut-short put-back left
                handler = handler.handlers[signum]
            if callable(handler):  # SIG_DFL and SIG_IGN are not: the OS acts on those
                self.handlers[signum] = handler
                signal.signal(signum, self)

    def release(self) -> None:
        """Put the handlers back, then run them for the signals caught meanwhile."""
        global _holding
        self.held = False  # from here a signal goes on to its handler, whatever else happens
        _holding = False
        try:
            for signum, handler in self.handlers.items():
                if signal.getsignal(signum) is self:
                    signal.signal(signum, handler)
        finally:
            caught, self.caught = self.caught, []
            for index, (signum, frame) in enumerate(caught):
                try:
                    self.handlers[signum](signum, frame)
                except BaseException:
                    for later, _ in caught[index + 1 :]:  # pending again, as the OS keeps them
                        os.kill(os.getpid(), later)
                    raise


def beneath_hold(handler: Any, signum: int) -> Any:
    """``handler``, or where it is a hold (:func:`interrupts_held`), the handler it stands
    in for: the one it puts back at its end, unless that one is replaced meanwhile (a
    notice source closed inside the hold replaces its own, and the hold leaves that be)."""
    while isinstance(handler, _Hold) and signum in handler.handlers:
        handler = handler.handlers[signum]
    return handler


_holding = False  # the main thread's signals are held now (nested holds add nothing)
_to_the_end = False  # inside held_to_the_end: a hold's end waits for it
_deferred: list[_Hold] = []  # holds that ended inside held_to_the_end, still holding


def on_main_thread() -> bool:
    """Whether this is the thread Python runs signal handlers on."""
    return threading.current_thread() is threading.main_thread()


def _release_deferred() -> None:
    while _deferred:
        _deferred.pop(0).release()


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold the signals with Python handlers until the block ends, then handle them."""
    global _holding
    if not on_main_thread():
        yield
        return
    if not _to_the_end:
        _release_deferred()  # an end of held_to_the_end that was cut short
    if _holding:  # nested: the outer hold holds
        yield
        return
    hold = _Hold()
    _holding = True
    try:
        hold.install()
        yield
    finally:
        if _to_the_end:
            _deferred.append(hold)  # still holding: held_to_the_end releases it
        else:
            hold.release()


class held_to_the_end:  # lower case: a context manager, named like contextlib's
    """Signals held by :func:`interrupts_held` inside this block stay held until it ends."""

    def __enter__(self) -> None:
        global _to_the_end
        self.outer = not _to_the_end and on_main_thread()
        if self.outer:
            _to_the_end = True  # last: from here the block's exit releases what it held

    def __exit__(self, *exc: object) -> None:
        global _to_the_end
        if self.outer:
            _to_the_end = False
            _release_deferred()
