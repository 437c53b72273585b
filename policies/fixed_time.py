"""Checkpoint every ``seconds`` of wall time, whatever the cost: the time-based baseline."""

from __future__ import annotations

from typing import Any

from pcframe.policies.base import PolicyContext
from pcframe.policies.periodic import SecondsIntervalPolicy
from pcframe.policies.registry import register


@register()
class FixedTime(SecondsIntervalPolicy):
    """Save when ``seconds`` have passed since the last save started.

    Args:
        seconds: the interval.
        concurrency: as in :class:`SecondsIntervalPolicy`; ``None`` (default) keeps the interval
            exactly fixed even when saves take longer than it.
    """

    name = "fixed_time"

    def __init__(self, seconds: float = 600.0, concurrency: int | None = None, **kw: Any) -> None:
        if not seconds > 0:
            raise ValueError(f"FixedTime: seconds={seconds} must be > 0")
        kw.setdefault("min_interval", 0.0)
        super().__init__(concurrency=concurrency, **kw)
        self.seconds = float(seconds)

    def target_interval(self, ctx: PolicyContext) -> float:
        return self.seconds
