"""Bookkeeping shared by rate predictors: how long the job was exposed to preemption."""

from __future__ import annotations

from typing import Any

from pcframe.policies.base import Event, Preempted, Restarted


class ExposureClock:
    """Turns ``advance``/``observe`` calls into (exposure seconds, preemption) increments.

    Exposure runs from one ``advance`` to the next. A preemption stops it (the VM is gone)
    and so does a restart; the next ``advance`` starts it again, so downtime is never counted
    and the restarted process's clock need not match the old one's.
    """

    def __init__(self) -> None:
        self.last: float | None = None

    def advance(self, now: float) -> float:
        """Seconds of exposure since the previous call (0 for the first, or a clock jump)."""
        if self.last is None or now < self.last:
            self.last = now
            return 0.0
        dt, self.last = now - self.last, now
        return dt

    def observe(self, event: Event) -> tuple[float, int]:
        """``(exposure seconds, preemptions)`` that ``event`` adds."""
        if isinstance(event, Preempted):
            dt = self.advance(event.time) if self.last is not None else 0.0
            self.last = None
            return dt, 1
        if isinstance(event, Restarted):
            self.last = None
        return 0.0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        last = state.get("last")
        self.last = None if last is None else float(last)
