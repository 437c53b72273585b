"""What the framework integrations share: the import guard, the policy argument, ``resume=``."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from pcframe.policies.base import IntervalPolicy
from pcframe.policies.fixed import FixedSteps
from pcframe.policies.registry import create

DEFAULT_EVERY = 100  # steps between versions when neither a policy nor an interval is given


def require_library(module: str, integration: str, extra: str) -> ModuleType:
    """Import ``module`` or raise the one-line error that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"pcframe.integrations.{integration} needs {extra}: pip install 'pcframe[{extra}]'"
        ) from exc


def resolve_policy(
    policy: IntervalPolicy | str | None,
    every: int | None,
    every_name: str,
    options: dict[str, Any] | None = None,
) -> IntervalPolicy:
    """The interval policy from ``policy=`` (an object or a registered name) or ``every``.

    ``every`` is the framework's own spelling of a fixed interval (``every_n_train_steps``,
    ``save_steps``); giving both it and a policy is ambiguous and refused.
    """
    if policy is not None and every is not None:
        raise ValueError(
            f"give either policy= or {every_name}= (it means policy=FixedSteps({every})), not both"
        )
    if options and not isinstance(policy, str):
        raise ValueError("policy_options= goes with a policy name, e.g. policy='young'")
    if isinstance(policy, str):
        try:
            made = create(policy, **(options or {}))
        except KeyError as exc:
            raise ValueError(str(exc.args[0])) from None
        except TypeError as exc:
            raise ValueError(f"policy {policy!r}: {exc} (check policy_options=)") from None
        policy = made
    if policy is None:
        return FixedSteps(every if every is not None else DEFAULT_EVERY)
    if not isinstance(policy, IntervalPolicy):
        raise TypeError(
            f"policy= must be a pcframe.policies interval policy or its name, not "
            f"{type(policy).__name__} (e.g. pcframe.policies.FixedSteps(50) or 'young')"
        )
    return policy


def check_resume(resume: Any) -> bool | int:
    """``"auto"`` (newest valid version) -> True, ``False`` (never), or a version number."""
    if resume == "auto" or resume is True:
        return True
    if resume is False or resume is None:
        return False
    if isinstance(resume, int) and resume >= 1:  # versions count from 1
        return resume
    raise ValueError(
        f"resume={resume!r}: use 'auto' (the newest valid version), False, or a version "
        "number (1 or more)"
    )
