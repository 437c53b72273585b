"""The classes a state tree names: how a value's class is written (``[module, qualname]``)
and found again on restore.

Security: a checkpoint is data, and may be hostile. A module it names is never imported
(importing runs the module's code): a class is looked up among the modules this process has
already imported (:func:`named_class`), through ``__dict__`` (no ``__getattr__`` or
descriptor runs), and used only if it is of the kind its tag says (a namedtuple class, an
``enum.Enum``, a class for a defaultdict's factory), never a function, which a restore would
then call. So a restore needs the training code's modules imported, as the training script
has them; ``pcframe verify`` decodes without looking classes up.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

from pcframe.errors import ManifestError, UnstorableState


def is_namedtuple_class(kind: type) -> bool:
    """Whether ``kind`` is a namedtuple class (``collections.namedtuple``, ``NamedTuple``)."""
    fields = getattr(kind, "_fields", None)
    return issubclass(kind, tuple) and isinstance(fields, tuple)


def class_names(kind: type, path: str, what: str) -> list[str]:
    """``[module, qualname]`` of a class a reader can find again by that name."""
    module, qualname = getattr(kind, "__module__", None), getattr(kind, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)) or (
        named_class(module, qualname) is not kind
    ):
        raise UnstorableState(
            f"cannot checkpoint the {what} at '{path}': its class {module}.{qualname} cannot "
            "be found again by that name (made inside a function, or under another name); "
            "define it at module level under its own name, or store a plain value in the "
            "object's state_dict()"
        )
    return [module, qualname]


def factory_names(factory: Any, path: str) -> list[str] | None:
    """A defaultdict's ``default_factory`` as the names of its class (None stays None)."""
    if factory is None:
        return None
    if not isinstance(factory, type):
        # A file that names a function a restore would call on a missing key could call any
        # function of any module imported: only classes (list, int, a class of yours).
        name = getattr(factory, "__qualname__", type(factory).__name__)
        raise UnstorableState(
            f"cannot checkpoint the defaultdict at '{path}': its default_factory {name} is "
            "not a class, and a checkpoint names only classes (list, int, dict, a class "
            "defined at module level); use one, e.g. defaultdict(list), or store dict(value) "
            "and rebuild the defaultdict in load_state_dict()"
        )
    return class_names(factory, path, "defaultdict's default_factory")


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
