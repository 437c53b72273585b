"""The bookkeeping of a simulated job: its checkpoints, its ledger of time, its versions."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pcframe.errors import PolicyError
from pcframe.format.tree import MAX_DEPTH
from pcframe.policies.base import SaveCompleted

SaveCost = tuple[float, float]  # one save's (stall, time to durable) as the engine measures it


@dataclass
class Commit:
    """The newest durable checkpoint: what a restart restores."""

    step: int = 0
    version: int = 0
    time: float = -math.inf
    policy_state: dict[str, Any] | None = None
    life: int = -1  # index of the process that wrote it (-1: none yet)
    # What its save cost, (stall, time to durable), as the engine records it in the version:
    # the restored policy learns it, since its state was taken before the save completed.
    cost: SaveCost | None = None


@dataclass
class Flight:
    """A save not yet reported to the policy (it may already be durable)."""

    version: int
    step: int
    start: float
    durable_at: float
    stall: float
    policy_state: dict[str, Any] | None


@dataclass
class Ledger:
    """Seconds and counts of the whole job, summed over its processes."""

    useful: float = 0.0
    lost: float = 0.0
    stall: float = 0.0
    restart: float = 0.0
    waiting: float = 0.0
    kept_steps: int = 0
    lost_steps: int = 0
    saves: int = 0
    saves_lost: int = 0
    emergency_saves: int = 0
    decisions: int = 0
    fast_forwards: int = 0
    rollbacks: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    # The step of every save started, in order (None: not recorded, SimOptions.record_saves).
    # One entry per count in ``saves``: a rollback truncates it to the restored count.
    save_steps: list[int] | None = None

    def saved(self, steps: Sequence[int]) -> None:
        """Count the saves started at ``steps`` (and record them, when recording)."""
        self.saves += len(steps)
        if self.save_steps is not None:
            self.save_steps.extend(steps)

    def set_saves(self, count: int) -> None:
        """Go back to ``count`` saves (a fast-forward's rollback)."""
        self.saves = count
        if self.save_steps is not None:
            del self.save_steps[count:]


class Versions:
    """The engine's version counter: every save takes the next number."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int = 1) -> int:
        first = self.next
        self.next += n
        return first


def by_durable(f: Flight) -> float:
    return f.durable_at


def measured(f: Flight) -> SaveCost:
    """The stall and time to durable the engine reports for ``f``, to the nanosecond as a
    clock would: the last bits of ``durable_at - start`` follow the absolute time, and a
    policy whose learned cost sits on a threshold (CheckFreq's ceil((duration - stall) /
    t_iter)) would follow them, skipping saves a steady run never skips."""
    return save_cost(f.stall, f.start, f.durable_at)


def save_cost(stall: float, start: float, durable_at: float) -> SaveCost:
    """A save's (stall, time to durable), rounded as :func:`measured` says."""
    return round(stall, 9), round(durable_at - start, 9)


def restored_completion(commit: Commit, at: float, nbytes: int) -> list[SaveCompleted]:
    """What the engine tells a policy restored from ``commit`` before ``Restarted``: the
    completion of the save that wrote it (its state was taken when that save started, so
    it never saw it finish), with the costs the version records; none without a version."""
    if commit.version <= 0 or commit.cost is None:
        return []
    stall, duration = commit.cost
    return [SaveCompleted(commit.version, commit.step, at, stall, duration, nbytes)]


def saved_state(policy: Any) -> Any:
    """The policy's state as a version holds it: a JSON copy, as the engine writes it.

    Not the object ``state_dict()`` returned: a plugin that returns its own live dict would
    otherwise get back, at a restart, what it learned after the checkpoint.
    """
    state = policy.state_dict()  # its own errors are its own (named as the plugin's)
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as exc:
        raise PolicyError(
            f"{type(policy).__name__}.state_dict() is not JSON ({exc}): a checkpoint could not "
            "hold it; return dicts, lists, strings, numbers, booleans and None"
        ) from None
    except RecursionError:  # json's own, raw; the engine refuses such a state by its depth
        raise PolicyError(
            f"{type(policy).__name__}.state_dict() is nested deeper than Python can copy, and "
            f"the engine stores at most {MAX_DEPTH} levels; flatten it"
        ) from None
