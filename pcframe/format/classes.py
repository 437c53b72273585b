"""The classes a state tree names: how a value's class is written (``[module, qualname]``)
and found again on restore.

Security: a checkpoint is data, and may be hostile. A module it names is never imported
(importing runs the module's code): a class is looked up among the modules this process has
already imported (:func:`named_class`), through ``__dict__`` (no ``__getattr__`` or
descriptor runs), and used only if it is of the kind its tag says (a namedtuple class, an
``enum.Enum`` with members, a built-in type as a defaultdict's factory: a restore calls the
factory, so no other class, nor a function); an enum member is found in its class's table
of values, without calling the class (a Flag's combination excepted). So a restore needs
the training code's modules imported, as the training script has them; ``pcframe verify``
decodes without looking classes up.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from pcframe.errors import ManifestError, UnstorableState

log = logging.getLogger("pcframe")


def is_namedtuple_class(kind: type) -> bool:
    """Whether ``kind`` is a namedtuple class (``collections.namedtuple``, ``NamedTuple``)."""
    fields = getattr(kind, "_fields", None)
    return issubclass(kind, tuple) and isinstance(fields, tuple)


def unfindable(kind: type, path: str, what: str) -> UnstorableState:
    """The error for a value at ``path`` whose class no reader could find by its name (and
    that has no base type to be stored as, e.g. a plain ``Enum`` made in a function)."""
    return UnstorableState(
        f"cannot checkpoint the {what} at '{path}': its class "
        f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', '?')} cannot "
        "be found again by that name (made inside a function, or under another name); "
        "define it at module level under its own name, or store a plain value in the "
        "object's state_dict()"
    )


def findable_names(kind: type) -> list[str] | None:
    """``[module, qualname]`` of ``kind`` if a reader can find it again by that name (None:
    made inside a function, or known under another name)."""
    module, qualname = getattr(kind, "__module__", None), getattr(kind, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)):
        return None
    if named_class(module, qualname) is not kind:
        return None
    return [module, qualname]


# The only classes a file may name as a defaultdict's factory: a restore calls the factory
# at the next missing key, so a hostile file naming any other class it finds imported
# (tempfile.TemporaryDirectory, a class whose __init__ acts) would run its constructor.
SAFE_FACTORIES: frozenset[type] = frozenset(
    {list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bytearray, bool}
    | {Counter, OrderedDict, defaultdict, deque}
)


def factory_names(factory: Any) -> list[str] | bool | None:
    """A defaultdict's ``default_factory`` as the names of its class (None stays None);
    False where a checkpoint cannot name it (not one of :data:`SAFE_FACTORIES`)."""
    if factory is None:
        return None
    if factory not in SAFE_FACTORIES:
        return False
    names = findable_names(factory)
    return False if names is None else names


@contextlib.contextmanager
def base_types_unannounced() -> Iterator[None]:
    """No :func:`kept_as_base` warning inside: for an encoding made only to compare (DCP
    pickles a value whose type the tree would not keep, so nothing is lost there)."""
    token = _UNANNOUNCED.set(True)
    try:
        yield
    finally:
        _UNANNOUNCED.reset(token)


def kept_as_base(path: str, what: str, base: str) -> None:
    """Log once per place that a value is stored as its base type (its own is not kept)."""
    if _UNANNOUNCED.get() or (path, what) in _WARNED:
        return
    _WARNED.add((path, what))
    log.warning(
        "the %s at '%s' is checkpointed as a plain %s and comes back as one: %s",
        what,
        path,
        base,
        "pcframe keeps the type of Counter, OrderedDict, namedtuples and enum members "
        "defined at module level, and of defaultdicts whose default_factory is a built-in "
        "type (list, int, dict, set, ...)",
    )


_WARNED: set[tuple[str, str]] = set()
_UNANNOUNCED: ContextVar[bool] = ContextVar("pcframe_base_types_unannounced", default=False)


class ClassProblem(Exception):
    """A class named at ``node`` that this process cannot give the value back as."""

    def __init__(self, node: Any, message: str) -> None:
        super().__init__(message)
        self.node = node


def named_class(module: str, qualname: str) -> Any:
    """What ``module.qualname`` names among the modules this process has imported (None:
    nothing). Never imports, and reads names from ``__dict__`` only: a checkpoint may be
    hostile (module docstring); the caller checks the kind of what it gets."""
    owner: Any = sys.modules.get(module)
    for part in qualname.split("."):
        try:
            owner = vars(owner).get(part) if owner is not None else None
        except TypeError:  # no __dict__
            return None
    return owner


def resolve_class(names: list[str], node: Any, what: str, fits: Callable[[type], bool]) -> type:
    """The class ``[module, qualname]`` names, if it is one of the kind ``fits`` accepts."""
    module, qualname = names
    found = named_class(module, qualname)
    if found is None:
        where = (
            "define it in the restoring script too, or in a module both scripts import"
            if module == "__main__"
            else f"import {module} before the restore"
        )
        raise ClassProblem(
            node,
            f"its {what} {module}.{qualname} is not defined in this process: {where} "
            "(pcframe looks a checkpoint's classes up among the modules already imported, "
            "and never imports one a checkpoint names)",
        )
    if not isinstance(found, type) or not fits(found):
        raise ClassProblem(
            node,
            f"the checkpoint names {module}.{qualname} as its {what}, but in this process "
            f"that is a {type(found).__name__}: restore with the code it was saved with",
        )
    return found


# A class's module and qualified name: dotted identifiers ("<locals>" is never written).
_DOTTED = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*")
MAX_CLASS_NAME = 512


def checked_names(value: Any, tag: str) -> list[str]:
    """``value`` as a written ``[module, qualname]`` (of a ``tag`` node), else ManifestError."""
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(
            isinstance(v, str) and len(v) <= MAX_CLASS_NAME and _DOTTED.fullmatch(v) for v in value
        )
    ):
        raise ManifestError(f"malformed class name {value!r:.80} in '{tag}' ([module, qualname])")
    return value
