"""The five kinds of pcframe plugin, each named by the ABC its classes derive from.

Every plugin ABC declares its kind with :func:`plugin_base`; :func:`kind_of` asks the
declared bases. A class can only derive from a base whose module has been imported, so the
base of every class :func:`kind_of` is given has declared itself by then. This module imports
nothing of pcframe: the ABCs and the registry both build on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

KINDS = ("interval", "placement", "resource", "predictor", "notice_source")

T = TypeVar("T")

_BASES: dict[str, type] = {}


def plugin_base(kind: str) -> Callable[[type[T]], type[T]]:
    """Class decorator for a plugin ABC: the classes derived from it are plugins of ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {', '.join(KINDS)}")

    def declare(cls: type[T]) -> type[T]:
        _BASES[kind] = cls
        return cls

    return declare


def kind_of(obj: Any) -> str:
    """The plugin kind of a class, from the ABC it derives from; ``TypeError`` if none."""
    if isinstance(obj, type):
        for kind in KINDS:
            base = _BASES.get(kind)
            if base is not None and issubclass(obj, base):
                return kind
    raise TypeError(
        f"{obj!r} is not a subclass of IntervalPolicy, PlacementPolicy, ResourcePolicy, "
        "Predictor or NoticeSource; derive from one of them to register it"
    )
