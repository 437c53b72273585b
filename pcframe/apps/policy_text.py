"""How ``pcframe-run`` names the policy it ran, and says why a run committed nothing.

The summary's ``policy`` column comes from the live policy in an in-process run
(:func:`describe_policy`: its interval as last computed) and from its config node in a
supervised one, whose policy lives in the child (:func:`policy_from_config`). A third-party
policy shows its plain constructor arguments.
"""

from __future__ import annotations

import inspect
from typing import Any

from omegaconf import DictConfig

from pcframe.policies.fixed import FixedSteps
from pcframe.text import seconds_text


def describe_policy(policy: Any) -> str:
    """``"FixedSteps: every 100 steps"``, ``"Young: interval 84.9 s"``, or the class name."""
    name = type(policy).__name__
    if isinstance(policy, FixedSteps):
        return f"{name}: every {policy.every} steps"
    if not type(policy).__module__.startswith("pcframe."):
        return _describe_plugin(policy)
    seconds = getattr(policy, "seconds", None)
    if isinstance(seconds, int | float):
        return f"{name}: every {seconds:g} s"
    interval = getattr(policy, "last_interval", None)
    if isinstance(interval, int | float):
        return f"{name}: interval {seconds_text(interval)} s (as last computed)"
    k = getattr(policy, "k", None)
    if isinstance(k, int):
        return f"{name}: every {k} steps (as last computed)"
    return name


def _describe_plugin(policy: Any) -> str:
    """A third-party policy: ``"StepsOrSeconds(steps=5, seconds=900)"`` (its plain
    constructor arguments that it keeps as attributes of the same name)."""
    name = type(policy).__name__
    try:
        params = inspect.signature(type(policy)).parameters
    except (TypeError, ValueError):
        return name
    shown = []
    for key in params:
        value = getattr(policy, key, None)
        if isinstance(value, bool | int | float | str):
            shown.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
    return f"{name}({', '.join(shown)})" if shown else name


def policy_from_config(node: DictConfig) -> str:
    target = str(node.get("_target_", "policy"))
    name = target.rsplit(".", 1)[-1]
    if not target.startswith("pcframe."):  # a plugin: its plain arguments
        values = {str(k): v for k, v in node.items() if not str(k).startswith("_")}
        plain = [f"{k}={v}" for k, v in values.items() if isinstance(v, bool | int | float | str)]
        return f"{name}({', '.join(plain)})" if plain else name
    if "every" in node:
        return f"{name}: every {node.every} steps"
    if "seconds" in node:
        return f"{name}: every {node.seconds:g} s"
    return name


def no_commit_reason(
    policy: Any, cfg: DictConfig, seconds: float, start_step: int, failed: list[Any]
) -> str:
    """Why a run committed no checkpoint, and what to change."""
    trained = cfg.steps - start_step
    head = "no checkpoint was committed: "
    if trained <= 0:
        return head + (
            f"the checkpoint folder already held step {start_step}, so there was nothing "
            "left to train; give a new directory=... or more steps"
        )
    if failed:
        return head + f"{len(failed)} save(s) failed, the first with: {failed[0].error}"
    if isinstance(policy, FixedSteps):
        return head + (
            f"FixedSteps saves every {policy.every} steps, but the run had {trained} steps: "
            "the interval is longer than the run; lower policy.interval.every (e.g. "
            f"policy.interval.every={max(1, trained // 5)}) or raise steps"
        )
    interval = getattr(policy, "last_interval", None) or getattr(policy, "seconds", None)
    name = type(policy).__name__
    if isinstance(interval, int | float):
        return head + (
            f"{name}'s interval is {seconds_text(interval)} s, but training took "
            f"{seconds_text(seconds)} s: the interval is longer than the run; choose a "
            "shorter one (e.g. policy/interval=fixed_steps policy.interval.every=20) or raise steps"
        )
    return head + (
        f"{name} asked for no save in {trained} steps ({seconds_text(seconds)} s): its "
        "interval is longer than the run; choose a shorter one or raise steps"
    )
