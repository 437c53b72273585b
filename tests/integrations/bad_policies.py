"""Policies of a user's that break their contract part way through a run: what the
callbacks must report as one line naming the policy (tests of both frameworks)."""

from __future__ import annotations

import re
from typing import Any

from pcframe.policies import Decision, FixedSteps, PolicyContext
from pcframe.policies.base import IntervalPolicy
from pcframe.policies.placement import PlacementContext, PlacementDecision, PlacementPolicy

BAD_FROM = 5  # the interval policy's first bad answer (steps before save at 3)


class AnswersNone(IntervalPolicy):
    """Saves every 3 steps; from step ``BAD_FROM`` on it returns None (a bug)."""

    name = "answers_none"

    def decide(self, ctx: PolicyContext) -> Decision:
        if ctx.step >= BAD_FROM:
            return None  # type: ignore[return-value]
        return Decision(ctx.step > 0 and ctx.step % 3 == 0, "every 3 steps")


class PlacesNothing(PlacementPolicy):
    """Every version to the primary and a replica; from version 2 on, place() raises."""

    name = "places_nothing"

    @property
    def tiers(self) -> tuple[str, ...]:
        return ("local", "replica")

    def place(self, ctx: PlacementContext) -> PlacementDecision:
        if ctx.version >= 2:
            raise RuntimeError("no tier for this version")
        keep = {"local": (ctx.version,), "replica": (ctx.version,)}
        return PlacementDecision(("local", "replica"), keep=keep)


def options(kind: str, directory: Any) -> dict[str, Any]:
    """The callback's options for a run whose ``kind`` of policy breaks."""
    if kind == "interval":
        return {"policy": AnswersNone()}
    replica = directory.parent / "replica"
    return {"policy": FixedSteps(3), "tiers": {"replica": replica}, "placement": PlacesNothing()}


# The policy's own line, as the callback must show it inside its own (a regex).
SAID = {
    "interval": (
        r"policy tests\.integrations\.bad_policies\.AnswersNone\.decide returned None; it must "
        r"return pcframe\.policies\.Decision\(save=\.\.\., reason=\.\.\.\)"
    ),
    "placement": (
        r"placement policy 'places_nothing' \(tests\.integrations\.bad_policies\.PlacesNothing\)"
        r"\.place raised RuntimeError: no tier for this version for version \d+; .* Fix: make "
        r"place\(\) return a PlacementDecision for every version instead of raising"
    ),
}


def check_stopped_line(error: BaseException, owner: str, again: str, kind: str, steps: int) -> None:
    """``error`` is the callback's one line for a broken policy of ``kind`` in a run of
    ``steps`` steps: the callback (``owner``), the step, the policy's own line, and what to do
    (``again``: a regex of how the framework resumes); the engine's error is its cause."""
    message = str(error)
    assert "\n" not in message, message
    said = re.fullmatch(
        rf"{owner}(?: stopped training at step (\d+):|: training ended at step \d+, but) "
        rf"{SAID[kind]}\. No committed version was lost: fix the policy and {again} again to "
        r"resume from the newest one",
        message,
    )
    assert said is not None, message
    if kind == "interval":
        assert said[1] == str(BAD_FROM), message  # it stopped there
    if steps == 4:  # found by the close, after the last step's version 2
        assert said[1] is None and "ended at step 4, but" in message, message
    assert isinstance(error.__cause__, type(error))  # the engine's error, kept
