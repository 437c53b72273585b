"""The policy feed: the measurements an interval policy sees, in one place.

The engine (:class:`~pcframe.checkpointer.Checkpointer`) and the trace-driven simulator
(:class:`~pcframe.sim.process.Process`) both tell a :class:`PolicyFeed` what happened (a
step was reached, a save started, a save became durable, training resumed from a
checkpoint) and ask it for the :class:`~pcframe.policies.base.PolicyContext` a policy
decides on. The feed never reads a clock: every time is passed in by the caller (the
engine's ``time.monotonic()``, the simulator's trace seconds), so both see the same
arithmetic.

Smoothed measurements use :func:`ewma` with :data:`EWMA_WEIGHT`; the replica tiers smooth
their write times and throughput with the same function.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from pcframe.policies.base import Notice, PolicyContext
from pcframe.policies.notices.base import NoticeSource, polled

EWMA_WEIGHT = 0.3  # weight of the newest sample in every smoothed measurement


def ewma(previous: float | None, sample: float, weight: float = EWMA_WEIGHT) -> float:
    """Exponentially weighted moving average: ``sample`` itself when there is no previous."""
    return sample if previous is None else (1 - weight) * previous + weight * sample


class PolicyFeed:
    """Measurements of one training process, turned into a :class:`PolicyContext`.

    Attributes (``None`` until measured; the names are those of :class:`PolicyContext`):
        iteration_time: EWMA of seconds per step, from :meth:`stepped`.
        save_stall: EWMA of seconds the training thread was blocked per committed save.
        save_duration: EWMA of seconds from save to durable per committed save.
        restart_cost: seconds from process start to training resumed (:meth:`resumed`).
        last_save_step, last_save_time: step and time of the last save started (or, after
            :meth:`resumed`, the step restored; its time stays unknown).

    A caller that knows a measurement instead of measuring it (the simulator knows its
    iteration time) passes it to the constructor and does not report samples of it.
    """

    __slots__ = (
        "_last_call",
        "iteration_time",
        "last_save_step",
        "last_save_time",
        "restart_cost",
        "save_duration",
        "save_stall",
    )

    def __init__(self, *, iteration_time: float | None = None) -> None:
        self.iteration_time = iteration_time
        self.save_stall: float | None = None
        self.save_duration: float | None = None
        self.restart_cost: float | None = None
        self.last_save_step: int | None = None
        self.last_save_time: float | None = None
        self._last_call: tuple[int, float] | None = None  # (step, now) of the last stepped()

    # --- measurements ----------------------------------------------------------------------

    def stepped(self, step: int, now: float) -> None:
        """The training loop is at ``step`` at time ``now`` (a policy is about to be asked).

        Samples the iteration time ``(now - then) / (step - step_then)`` against the previous
        call, only when the step advanced since; the previous call becomes this one either way.
        """
        last = self._last_call
        if last is not None and step > last[0]:
            sample = (now - last[1]) / (step - last[0])
            self.iteration_time = ewma(self.iteration_time, sample)
        self._last_call = (step, now)

    def saved(self, step: int, now: float) -> None:
        """A save of ``step`` was started; the training thread is free again at ``now``."""
        self.last_save_step, self.last_save_time = step, now

    def committed(self, stall: float, durable: float) -> None:
        """A save became durable: it blocked training ``stall`` s and took ``durable`` s."""
        self.save_stall = ewma(self.save_stall, stall)
        self.save_duration = ewma(self.save_duration, durable)

    def resumed(self, step: int, restart_cost: float) -> None:
        """Training goes on from the restored ``step``; starting again took ``restart_cost`` s.

        The next :meth:`stepped` takes no iteration-time sample (the restart is not a step).
        """
        self.restart_cost = restart_cost
        self.last_save_step = step
        self._last_call = None

    # --- the policy's view -----------------------------------------------------------------

    def context(
        self,
        step: int,
        now: float,
        *,
        notice: Notice | None = None,
        wall_time: float | None = None,
        in_flight: int = 0,
        max_in_flight: int | None = None,
        tier_write_times: dict[str, float] | None = None,
        preemption_rate: float | None = None,
    ) -> PolicyContext:
        """The :class:`PolicyContext` at ``step`` and ``now`` from the measurements so far.

        What the feed does not measure is passed in: the pending ``notice``, the Unix time
        at ``now``, the saves not yet durable (and how many may be), the tiers' estimated
        write times and a predicted preemption rate.
        """
        return PolicyContext(
            step=step,
            now=now,
            last_save_step=self.last_save_step,
            last_save_time=self.last_save_time,
            iteration_time=self.iteration_time,
            save_stall=self.save_stall,
            save_duration=self.save_duration,
            restart_cost=self.restart_cost,
            preemption_rate=preemption_rate,
            notice=notice,
            in_flight=in_flight,
            max_in_flight=max_in_flight,
            tier_write_times={} if tier_write_times is None else tier_write_times,
            wall_time=wall_time,
        )


def earliest_notice(sources: Iterable[NoticeSource], now: float) -> Notice | None:
    """The pending preemption notice with the earliest deadline among ``sources``.

    A notice whose deadline has passed while this process still runs was a false alarm:
    its source is reset and the notice ignored.
    """
    found = None
    for source in sources:
        notice = polled(source, now)
        if notice is not None and now > notice.deadline:
            source.reset()
            continue
        if notice is not None and (found is None or notice.deadline < found.deadline):
            found = notice
    return found


def policy_notice(policy: Any, now: float) -> Notice | None:
    """The notice of a policy with its own source (``NoticeDriven(source=...)``), if any.

    Read when such a policy decided an emergency save, for the deadline the tiers must meet.
    """
    source = getattr(policy, "source", None)
    return polled(source, now) if isinstance(source, NoticeSource) else None


def process_age() -> float:
    """Seconds since this process started (the restart cost a resumed run measures).

    From Linux /proc; falls back to the time since this module was imported.
    """
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


_IMPORTED_AT = time.monotonic()
