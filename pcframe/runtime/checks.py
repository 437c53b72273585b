"""What a value given to pcframe must be, in one place: a number (Python's and numpy's, never
a bool: an int to Python, ``retries=True`` would be 1; NaN only where said), and an object
where a policy or another part goes (not its class or its registry name)."""

from __future__ import annotations

import math
import numbers
import threading
from typing import Any

from pcframe.text import value_text


def real_number(x: Any) -> bool:
    """A real number (numpy's scalars included), not a bool (numpy's bool is not a
    ``numbers.Real``)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def finite_number(x: Any) -> bool:
    """A finite real number, not a bool."""
    return real_number(x) and math.isfinite(x)


def whole_number(x: Any) -> bool:
    """An integer (numpy's included), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def bounded_wait(seconds: float) -> float | None:
    """A timeout for ``threading`` waits: at least 0, and ``None`` (no bound) past what they
    accept (an infinite notice window raised OverflowError from ``Condition.wait``)."""
    if seconds != seconds:  # NaN: no deadline to keep
        return None
    seconds = max(0.0, seconds)
    return None if seconds > threading.TIMEOUT_MAX else seconds


def require_object(
    key: str, given: Any, needs: type | str, kind: str, example: str, *, optional: bool = True
) -> None:
    """Refuse anything but a ``kind`` object as ``key=``: a class or a registry name given
    there failed only at its first use, deep inside ("decide() missing 1 required positional
    argument", "'str' object has no attribute 'decide'"). ``needs``: the type it must be an
    instance of, or the name of the method it must have (a user's class need not derive from
    pcframe's); ``None`` passes where ``optional``.

    Raises:
        TypeError: one line naming ``key``, what was given and the fix: the class called,
            or ``example`` (with a name, also the registry's ``create`` of that name).
    """
    if given is None and optional:
        return
    if isinstance(given, type):  # never an object, though it has the methods (as functions)
        what, fix = f"the class {given.__name__}", f"{key}={given.__name__}(...)"
    elif _has_kind(given, needs):
        return
    elif isinstance(given, str):
        name = value_text(given)
        what = f"the name {name}"
        fix = f"{key}=pcframe.policies.create({name}, ...) or {key}={example}"
    else:
        lacks = f" (it has no {needs}())" if isinstance(needs, str) else ""
        what, fix = f"{value_text(given)}{lacks}", f"{key}={example}"
    none = ", or None" if optional else ""
    raise TypeError(f"{key}= is {what}, not {kind} object: give one, e.g. {fix}{none}")


def _has_kind(given: Any, needs: type | str) -> bool:
    if isinstance(needs, type):
        return isinstance(given, needs)
    return callable(getattr(given, needs, None))
