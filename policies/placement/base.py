"""Placement: which storage tier(s) a checkpoint version goes to, and what each tier keeps."""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pcframe.errors import PolicyError
from pcframe.policies.base import REASON_FIX, Event, Notice, Stateful, reason_problem
from pcframe.policies.kinds import plugin_base


@dataclass(frozen=True)
class PlacementContext:
    """What the engine knows when version ``version`` (of step ``step``) is about to be written.

    Attributes:
        tier_write_times: estimated seconds to make this version durable in each tier the
            engine has configured (name -> seconds); tiers missing here are unknown.
        committed: versions already committed per tier, any order.
        notice: a pending preemption notice, if any.
    """

    version: int
    step: int
    now: float
    tier_write_times: Mapping[str, float] = field(default_factory=dict)
    committed: Mapping[str, Sequence[int]] = field(default_factory=dict)
    notice: Notice | None = None


@dataclass(frozen=True)
class PlacementDecision:
    """What the engine must do with the version.

    Attributes:
        tiers: tier names to write the version to, in order (fastest first).
        keep: per tier, the versions to keep once ``version`` has committed there; the
            engine may delete every other version of that tier *after* that commit (never
            before, so a failed write never costs the newest committed version).
        reason: human-readable, for logs.
    """

    tiers: tuple[str, ...]
    keep: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    reason: str = ""


@plugin_base("placement")
class PlacementPolicy(Stateful, ABC):
    """Chooses tiers and retention for every checkpoint version."""

    name: ClassVar[str] = ""

    @property
    @abstractmethod
    def tiers(self) -> tuple[str, ...]:
        """Every tier name this policy may ask for (the engine checks they are configured)."""

    @abstractmethod
    def place(self, ctx: PlacementContext) -> PlacementDecision:
        """Tiers and retention for ``ctx.version``."""

    def observe(self, event: Event) -> None:
        """Learn from what happened (e.g. measured write times)."""


# --- the contract of place(), checked where its answer is used ---------------------------------


def placement_name(policy: Any) -> str:
    """The policy as an error names it: its registered ``name`` and its class."""
    who = f"{type(policy).__module__}.{type(policy).__qualname__}"
    name = getattr(policy, "name", "")
    return f"{name!r} ({who})" if isinstance(name, str) and name else who


def ask_placement(
    policy: PlacementPolicy, ctx: PlacementContext, tiers: Sequence[str], then: str = ""
) -> PlacementDecision:
    """``policy.place(ctx)``, checked (:func:`checked_placement`); an exception it raises
    becomes a :class:`~pcframe.errors.PolicyError` naming the policy (chained to it).

    ``then``: what the caller's failure means (the engine's "version 5 is committed in the
    primary only ..."), put in the message before the fix.
    """
    try:
        decision = policy.place(ctx)
    except Exception as exc:
        problem = f"raised {type(exc).__name__}: {_shown(exc, 160)} for version {ctx.version}"
        fix = "make place() return a PlacementDecision for every version instead of raising"
        raise _error(policy, problem, then, fix) from exc
    return checked_placement(policy, decision, tiers, ctx.version, then)


def checked_placement(
    policy: PlacementPolicy, decision: Any, tiers: Sequence[str], version: int, then: str = ""
) -> PlacementDecision:
    """``decision`` if the engine and the simulator can follow it; else a one-line
    :class:`~pcframe.errors.PolicyError` naming the policy, what is wrong and the fix.

    A :class:`PlacementDecision` whose ``tiers`` is a non-empty tuple (or list) of names among
    ``tiers`` (the policy's own), and whose ``keep`` maps some of those names to collections of
    version numbers (ints). Before, a malformed answer failed deep in the engine (a commit
    listener's warning, or a version failed by its retention) or was read as another one (a
    string's letters taken for tier names).
    """
    known = list(tiers)
    found = _placement_problem(decision, known, version)
    if found is None:
        return decision
    problem, fix = found
    raise _error(policy, problem, then, fix)


def _placement_problem(decision: Any, known: list[str], version: int) -> tuple[str, str] | None:
    """(what is wrong, the fix) with ``decision``, or ``None``."""
    for_version = f"for version {version}"
    first = known[0] if known else "local"
    example = f"PlacementDecision(tiers=({first!r},), keep={{{first!r}: ({version},)}})"
    if not isinstance(decision, PlacementDecision):
        problem = f"returned {_shown(decision)} {for_version}, not a PlacementDecision"
        return problem, f"return a PlacementDecision naming some of its tiers {known}: {example}"
    names = decision.tiers
    if (
        isinstance(names, str | bytes)
        or not isinstance(names, Sequence)
        or not all(isinstance(name, str) for name in names)
    ):
        problem = f"returned tiers={_shown(names)} {for_version}, not a tuple of tier names"
        return problem, f"give tiers as a tuple of names, e.g. tiers=({first!r},)"
    if not names:
        problem = f"returned no tier {for_version}"
        return problem, f"name at least one of its tiers {known}"
    unknown = sorted(set(names) - set(known))
    if unknown:
        problem = f"placed version {version} in {unknown}, not among its tiers {known}"
        return problem, "name only tiers listed by its tiers property"
    keep = decision.keep
    if not isinstance(keep, Mapping):
        problem = f"returned keep={_shown(keep)} {for_version}, not a mapping of tier to versions"
        return problem, f"give keep as a dict of tier name to versions, e.g. {example}"
    unknown = sorted(map(repr, set(keep) - set(known)))
    if unknown:
        problem = f"returned keep for tier(s) {', '.join(unknown)} {for_version}, not among its "
        problem += f"tiers {known}"
        return problem, "key keep by the names its tiers property lists"
    for tier, versions in keep.items():
        if (
            isinstance(versions, str | bytes | Mapping)
            or not isinstance(versions, Collection)
            or not all(_is_version(v) for v in versions)
        ):
            problem = (
                f"returned keep[{tier!r}]={_shown(versions)} {for_version}, not a tuple of "
                "version numbers"
            )
            return problem, f"give the versions to keep as a tuple of ints, e.g. {example}"
    wrong_reason = reason_problem(decision.reason)
    if wrong_reason is not None:
        return f"returned a PlacementDecision {for_version} with {wrong_reason}", REASON_FIX
    return None


def _is_version(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _shown(value: Any, limit: int = 80) -> str:
    """``value`` (an exception: its message) on one line, at most ``limit`` characters."""
    try:
        text = str(value) if isinstance(value, BaseException) else repr(value)
    except Exception:  # a repr that raises: its type says enough
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error(policy: Any, problem: str, then: str, fix: str) -> PolicyError:
    then = f"; {then}" if then else ""
    who = placement_name(policy)
    return PolicyError(f"placement policy {who}.place {problem}{then}. Fix: {fix}")
