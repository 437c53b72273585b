"""The plugin points of pcframe: small abstract base classes and the context they see.

A policy never reads clocks or the engine directly: the engine (or the simulator) hands it a
frozen :class:`PolicyContext` and tells it what happened through :meth:`observe`. That keeps
policies deterministic, testable and usable unchanged in the trace-driven simulator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pcframe.errors import PolicyError
from pcframe.policies.kinds import plugin_base
from pcframe.text import value_text

# Deadlines closer than this (seconds) are one notice. A source recomputes the deadline from
# two clocks at every poll (``now`` and the signal's, the file's or the endpoint's time), so
# the same notice comes back microseconds apart; compared exactly, every step looked like a
# new notice and started another emergency save until the kill (seen in the replay
# validation: 36 commits instead of 19 in a 29 s replay).
SAME_NOTICE = 0.1


@dataclass(frozen=True)
class Notice:
    """A pending preemption notice: the VM goes away at ``deadline`` (same clock as ``now``)."""

    received_at: float
    deadline: float
    source: str = "signal"

    def same_as(self, other: Notice | None) -> bool:
        """Whether ``other`` is this notice seen again (its deadline within SAME_NOTICE)."""
        return other is not None and same_deadline(self.deadline, other.deadline)


def same_deadline(a: float, b: float) -> bool:
    """Whether two polls of a notice gave one deadline (an infinite one included: inf - inf
    is NaN, and a notice was then new at every step)."""
    return a == b or abs(a - b) <= SAME_NOTICE


@dataclass(frozen=True)
class PolicyContext:
    """Everything an interval policy may base a decision on. Times in seconds.

    Measured costs are ``None`` until the engine has measured them at least once.
    """

    step: int
    now: float
    last_save_step: int | None = None
    last_save_time: float | None = None
    iteration_time: float | None = None
    save_stall: float | None = None
    save_duration: float | None = None
    restart_cost: float | None = None
    preemption_rate: float | None = None
    notice: Notice | None = None
    in_flight: int = 0
    # Checkpoints the engine lets persist at once (its max_in_flight; None: not known).
    max_in_flight: int | None = None
    # Several tiers may be offered to placement-aware policies: name -> estimated write time.
    tier_write_times: dict[str, float] = field(default_factory=dict)
    # Unix time at ``now``, if the engine knows it. ``now`` may be a monotonic clock; policies
    # whose predictions depend on the time of day (hazard by hour) need the wall clock.
    wall_time: float | None = None


@dataclass(frozen=True)
class SaveHint:
    """When :meth:`IntervalPolicy.decide` can next answer ``save=True``.

    For callers that do not run every step (the trace simulator jumps from one candidate
    save point to the next instead of iterating 45 days step by step). ``decide`` will not
    say save before step ``step`` nor before time ``time`` (``ctx.now``'s clock); ``None``
    means no bound. ``every`` declares the policy periodic: from ``step`` on it saves exactly
    every ``every`` steps and neither ``decide`` nor ``observe(SaveCompleted)`` changes its
    state, until a ``Preempted``/``Restarted`` event or a notice.
    """

    step: int | None = None
    time: float | None = None
    every: int | None = None


@dataclass(frozen=True)
class Decision:
    save: bool
    reason: str = ""
    # An emergency save answers a preemption notice: the engine waits for it to be durable.
    emergency: bool = False


def _who(policy: Any) -> str:
    return f"{type(policy).__module__}.{type(policy).__qualname__}"


REASON_FIX = "give the reason as text, e.g. reason=f'every {n} steps', or leave it out"


def reason_problem(reason: Any) -> str | None:
    """What is wrong with a decision's ``reason``, or ``None`` where it is a ``str``: one
    line, the value cut to 60 characters. (A reason of another type was stored in the
    version's metadata as it was, failed later where no policy is named, bytes as 'metadata
    must be JSON-able', or was dropped where falsy.)"""
    if isinstance(reason, str):
        return None
    return f"reason={value_text(reason)} ({type(reason).__name__}): the reason must be a str"


_YES_NO = (True, False)  # numpy's booleans (and 0 and 1) compare equal to them too


def checked_decision(policy: Any, decision: Any) -> Decision:
    """``decision`` if it is a :class:`Decision`; else a :class:`PolicyError` naming the
    policy's class (before: an ``AttributeError`` deep in the engine or the simulator)."""
    if not isinstance(decision, Decision):
        raise PolicyError(
            f"policy {_who(policy)}.decide returned {decision!r:.80}; it must return "
            "pcframe.policies.Decision(save=..., reason=...)"
        )
    if decision.save not in _YES_NO or decision.emergency not in _YES_NO:
        # Decision(float("nan")) or Decision("no") was truthy: a save at every step
        raise PolicyError(
            f"policy {_who(policy)}.decide returned {decision!r:.120}; its save and "
            "emergency must be True or False"
        )
    problem = reason_problem(decision.reason)
    if problem is not None:
        raise PolicyError(
            f"policy {_who(policy)}.decide returned a Decision with {problem}. Fix: {REASON_FIX}"
        )
    return decision


_MAX_EVERY = 2**63 - 1  # the simulator's kernels count steps in int64


def checked_hint(policy: Any, hint: Any) -> SaveHint | None:
    """``hint`` if a caller can follow it: ``None`` or a :class:`SaveHint` whose ``every`` is
    an int >= 1, ``step`` an int and ``time`` a number (the simulator jumps by them)."""
    if hint is None:
        return None
    problem = None
    if not isinstance(hint, SaveHint):
        problem = f"returned {hint!r:.80}, not a SaveHint or None"
    elif hint.every is not None and (
        isinstance(hint.every, bool)
        or not isinstance(hint.every, int)
        or not 1 <= hint.every <= _MAX_EVERY
    ):
        # (past int64 it reached the simulator's Numba kernel: a raw TypingError)
        problem = (
            f"returned every={hint.every!r}: a period is an int >= 1 and below 2**63 (or None)"
        )
    elif hint.step is not None and (isinstance(hint.step, bool) or not isinstance(hint.step, int)):
        problem = f"returned step={hint.step!r}: a step is an int (or None)"
    elif hint.time is not None and (
        isinstance(hint.time, bool)
        or not isinstance(hint.time, int | float)
        or hint.time != hint.time
    ):
        problem = f"returned time={hint.time!r}: a time is a number on ctx.now's clock (or None)"
    if problem:
        raise PolicyError(
            f"policy {_who(policy)}.save_hint {problem}; return None when unsure (the "
            "simulator then asks decide at every step)"
        )
    return hint


# --- events the engine reports back to policies -------------------------------------------


@dataclass(frozen=True)
class SaveCompleted:
    """A checkpoint version became durable (committed)."""

    version: int
    step: int
    time: float
    stall: float  # seconds the training thread was blocked by this save
    duration: float  # seconds from save() to durable
    nbytes: int


@dataclass(frozen=True)
class Preempted:
    time: float
    lost_steps: int = 0


@dataclass(frozen=True)
class Restarted:
    time: float
    restart_cost: float  # seconds from process start to training resumed
    step: int = 0
    # The previous process closed its Checkpointer normally, with no preemption notice
    # pending: this restart is not a preemption (a finished job resumed, a planned stop).
    clean: bool = False
    # Processes started after the restored version was written that died before committing
    # a newer one (so their policy state was lost with them). Without it a policy learns
    # only from lives long enough to checkpoint: a survivor bias that hides the harshest
    # zones. The engine numbers the writers of a directory (``store.directory.Starts``);
    # the simulator counts the same lives.
    unseen_starts: int = 0


Event = SaveCompleted | Preempted | Restarted


class Stateful:
    """Learned state that travels inside the checkpoint (JSON-able values only)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


@plugin_base("interval")
class IntervalPolicy(Stateful, ABC):
    """Decides, at every step, whether to take a checkpoint now."""

    name: ClassVar[str] = ""
    # True where decide's answers may change with ``ctx.now`` alone (a re-prediction on the
    # policy's own clock) at points its save_hint names: a caller may skip the calls between
    # two hinted points but never one of them, so the simulator does not fast-forward over
    # several saves of such a policy with one call at the end.
    changes_with_clock: ClassVar[bool] = False

    @abstractmethod
    def decide(self, ctx: PolicyContext) -> Decision:
        """Return whether to save at ``ctx.step``. Must be cheap: it runs every step."""

    def observe(self, event: Event) -> None:
        """Learn from what happened (a save completed, a preemption, a restart)."""

    def save_hint(self, ctx: PolicyContext) -> SaveHint | None:
        """The earliest point at which :meth:`decide` could say save, or ``None`` if unknown.

        Called right after ``decide(ctx)`` with the same context, assuming no event or notice
        arrives in between; must not change state. A caller following it skips the calls
        of ``decide`` before the hinted point, so the hint must also come no later than any
        call that would change what later calls answer (a re-prediction on the policy's own
        clock): earlier is always exact, only slower. ``None`` (the default) tells a
        simulator to ask at every step.
        """
        del ctx
        return None
