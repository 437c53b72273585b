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
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._received is None:
            self._received = (time.monotonic(), signal.Signals(signum).name)
        prev = self._previous.get(signal.Signals(signum))
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
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
