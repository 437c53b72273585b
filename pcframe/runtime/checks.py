"""What a number given to pcframe must be, in one place: Python's and numpy's numbers, never
a bool (an int to Python: ``retries=True`` would be 1), and NaN only where said."""

from __future__ import annotations

import math
import numbers
import threading
from typing import Any


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
