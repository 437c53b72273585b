"""Preemption notice by POSIX signal (SIGTERM from a spot agent, SIGUSR1 from a wrapper)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from pcframe.policies.base import Notice
from pcframe.policies.notices.base import NoticeSource
from pcframe.policies.registry import register
from pcframe.runtime.interrupts import beneath_hold


@register()
class SignalNoticeSource(NoticeSource):
    """Records the first of ``signals`` as a notice with ``window`` seconds to live.

    The handler only stores a timestamp (async-signal-safe in spirit: no I/O, no locks); the
    training thread sees it at its next ``poll``. The default action of SIGTERM (terminate
    at once) is deliberately *not* chained, or there would be no time to save; a previous
    Python handler is called after ours when ``chain`` is true.

    Args:
        signals: names, e.g. ``["SIGTERM", "SIGUSR1"]``.
        window: seconds between the signal and the VM going away (GCP 30, AWS 120).
        chain: also call the handler that was installed before.
    """

    name = "signal"

    def __init__(
        self, signals: Sequence[str] = ("SIGTERM",), window: float = 30.0, chain: bool = True
    ) -> None:
        if not window > 0:  # NaN too: a notice with a NaN deadline was never acted on
            raise ValueError(f"window={window} must be > 0 seconds")
        self.signals = [self._resolve(s) for s in signals]
        uncatchable = [s.name for s in self.signals if s in (signal.SIGKILL, signal.SIGSTOP)]
        if uncatchable:  # refused now, not by signal.signal() at the first poll
            raise ValueError(
                f"signals={list(signals)}: {', '.join(uncatchable)} cannot be caught; use "
                "the signal the VM is told with, e.g. 'SIGTERM' or 'SIGUSR1'"
            )
        if not self.signals:
            raise ValueError("signals must name at least one signal, e.g. ['SIGTERM']")
        self.window = float(window)
        self.chain = chain
        self._received: tuple[float, str] | None = None  # (monotonic time, signal name)
        self._previous: dict[signal.Signals, Any] = {}
        # After close(), for the signals whose handler was no longer ours (one installed
        # later, which may still call ours): the handler ours replaced, to pass them on to.
        self._passed_on: dict[signal.Signals, Any] = {}

    @staticmethod
    def _resolve(name: str) -> signal.Signals:
        try:
            return signal.Signals[name.upper() if name.upper().startswith("SIG") else f"SIG{name}"]
        except KeyError:
            raise ValueError(f"unknown signal {name!r}; use e.g. 'SIGTERM' or 'SIGUSR1'") from None

    def start(self) -> None:
        if self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "SignalNoticeSource.start() must run in the main thread (Python installs "
                "signal handlers only there): start the source before training threads do"
            )
        self._passed_on.clear()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if sig in self._passed_on:  # closed, and called by a handler installed after ours
            _pass_on(self._passed_on[sig], sig, frame)
            return
        if self._received is None:
            self._received = (time.monotonic(), sig.name)
        prev = self._previous.get(sig)
        if self.chain and callable(prev):
            prev(signum, frame)

    def poll(self, now: float) -> Notice | None:
        if self._received is None:
            return None
        at, name = self._received
        received = now - (time.monotonic() - at)
        return Notice(received_at=received, deadline=received + self.window, source=name)

    def reset(self) -> None:
        self._received = None

    def close(self) -> None:
        """Put back the handler ours replaced, where ours is still the one installed.

        Where another was installed since (a framework's, or a second source's: two
        Checkpointers closed in the order they were opened), putting ours' predecessor back
        would throw that one away, and the later one would then put back ours, which kept
        taking the signal after every source was closed: SIGTERM no longer stopped the
        process. So that handler stays, and ours, if it still calls ours, passes the signal
        on to what ours replaced.
        """
        for sig, prev in self._previous.items():
            # Through a hold: Checkpointer.close() closes its sources with signals held.
            if beneath_hold(signal.getsignal(sig), sig) == self._handle:
                signal.signal(sig, _unwrapped(sig, prev))
            else:
                self._passed_on[sig] = prev
        self._previous.clear()


def _unwrapped(sig: signal.Signals, handler: Any) -> Any:
    """``handler``, or where it is a closed source's (one that only passes the signal on),
    what that one passes it on to; ``SIG_DFL`` for a handler not set from Python (None)."""
    while (
        callable(handler)
        and isinstance(source := getattr(handler, "__self__", None), SignalNoticeSource)
        and sig in source._passed_on
    ):
        handler = source._passed_on[sig]
    return handler if handler is not None else signal.SIG_DFL


def _pass_on(handler: Any, sig: signal.Signals, frame: FrameType | None) -> None:
    """What ``handler`` (the one a closed source replaced) does with ``sig``: call it, or
    ignore the signal, or its default action (put back, and the signal raised again: for
    SIGTERM the process ends, as if no source had been installed)."""
    handler = _unwrapped(sig, handler)
    if callable(handler):
        handler(sig, frame)
    elif handler != signal.SIG_IGN and sig not in _IGNORED_BY_DEFAULT:
        signal.signal(sig, signal.SIG_DFL)
        signal.raise_signal(sig)


# Signals whose default action is not to end the process: passing one on does nothing (and
# must not put SIG_DFL over the handler that called ours).
_IGNORED_BY_DEFAULT = frozenset(
    getattr(signal, name)
    for name in ("SIGCHLD", "SIGURG", "SIGWINCH", "SIGCONT")
    if hasattr(signal, name)
)
