"""Where preemption notices come from: a signal, a file, a cloud metadata endpoint.

A source is polled from the training thread with the engine's clock ``now``; it converts the
time the notice arrived on its own clock into that clock, so no source needs to know which
clock the engine uses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Self

from pcframe.policies.base import Notice
from pcframe.policies.kinds import plugin_base
from pcframe.policies.registry import register


@plugin_base("notice_source")
class NoticeSource(ABC):
    """Tells whether a preemption notice is pending. ``poll`` must be cheap: it runs per step."""

    name: ClassVar[str] = ""

    def start(self) -> None:  # noqa: B027 - optional hook
        """Begin listening (install handlers, start threads). Idempotent."""

    @abstractmethod
    def poll(self, now: float) -> Notice | None:
        """The pending notice, with times on the caller's clock ``now``; ``None`` if none."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Forget a notice that turned out to be a false alarm (the deadline passed)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop listening and release what :meth:`start` took. Idempotent."""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@register()
class ManualNoticeSource(NoticeSource):
    """A source the caller triggers itself: for tests, the simulator, or a custom watcher."""

    name = "manual"

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self._notice: Notice | None = None

    def trigger(self, now: float, window: float | None = None) -> None:
        self._notice = Notice(now, now + (self.window if window is None else window), "manual")

    def poll(self, now: float) -> Notice | None:
        return self._notice

    def reset(self) -> None:
        self._notice = None
