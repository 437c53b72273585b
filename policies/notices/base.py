"""Where preemption notices come from: a signal, a file, a cloud metadata endpoint.

A source is polled from the training thread with the engine's clock ``now``; it converts the
time the notice arrived on its own clock into that clock, so no source needs to know which
clock the engine uses.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Self

from pcframe.errors import PolicyError
from pcframe.policies.base import Notice
from pcframe.policies.kinds import plugin_base
from pcframe.policies.registry import register
from pcframe.text import value_text


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


def polled(source: NoticeSource, now: float) -> Notice | None:
    """``source.poll(now)``, checked: ``None`` or a :class:`Notice` whose times are numbers
    and whose deadline is not NaN. Else a :class:`PolicyError` naming the source's class (a
    user's source answering ``True`` or the deadline alone failed deep in pcframe with an
    AttributeError; a NaN deadline is neither to come nor past, so it stayed pending for
    ever). Every caller of ``poll`` goes through here."""
    notice = source.poll(now)
    if notice is None:
        return None
    problem = _notice_problem(notice)
    if problem is not None:
        who = f"{type(source).__module__}.{type(source).__qualname__}"
        raise PolicyError(
            f"notice source {who}.poll returned {value_text(notice, 120)}: {problem}. Fix: "
            "return None (no notice) or pcframe.policies.Notice(received_at, deadline, "
            "source) with times on the caller's clock `now`"
        )
    return notice


def _notice_problem(notice: Any) -> str | None:
    if not isinstance(notice, Notice):
        return "not a Notice or None"
    for key in ("received_at", "deadline"):
        value = getattr(notice, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            return f"its {key} is not a number of seconds"
    return None


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
