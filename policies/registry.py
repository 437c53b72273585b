"""Name registry of policies, predictors and notice sources, plus entry-point plugins.

Built-ins register themselves on import with the :func:`register` decorator. Third-party
packages declare an entry point in the group ``pcframe.policies``::

    [project.entry-points."pcframe.policies"]
    my_policy = "my_package.module:MyPolicy"

Entry points are listed without being imported; a plugin's code runs only when its name is
asked for, so one broken plugin cannot break ``available()`` for everybody.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from pcframe.policies.errors import PluginError
from pcframe.policies.kinds import KINDS, kind_of

ENTRY_POINT_GROUP = "pcframe.policies"

T = TypeVar("T")


class Registry:
    """Maps names to plugin classes. Separate instances are independent (tests use their own)."""

    def __init__(self, group: str | None = ENTRY_POINT_GROUP) -> None:
        self._classes: dict[str, type] = {}
        self._lazy: dict[str, md.EntryPoint] = {}
        self._group = group
        self._discovered = group is None

    # --- registration -----------------------------------------------------------------------
    def register(self, name: str, cls: type, *, replace: bool = False) -> type:
        if not name or not isinstance(name, str):
            raise ValueError(f"registry name must be a non-empty string, got {name!r}")
        kind_of(cls)  # rejects anything that is not a plugin class, with the fix in the message
        ep = self._lazy.get(name)
        if ep is not None and ep.value == _path(cls):
            del self._lazy[name]  # the class itself is also declared as an entry point
        if not replace:
            existing = self._classes.get(name)
            if existing is not None and existing is not cls:
                raise ValueError(
                    f"policy name {name!r} is already registered to "
                    f"{existing.__module__}.{existing.__qualname__}; pick another name"
                )
            if name in self._lazy:
                ep = self._lazy[name]
                raise ValueError(
                    f"policy name {name!r} is already declared by entry point {ep.value!r} "
                    f"(group {self._group!r}); pick another name"
                )
        self._classes[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        self._classes.pop(name, None)
        self._lazy.pop(name, None)

    # --- look-up ------------------------------------------------------------------------------
    def get(self, name: str) -> type:
        self._discover()
        if name in self._classes:
            return self._classes[name]
        if name in self._lazy:
            return self._load(name)
        raise KeyError(
            f"no policy named {name!r}; available: {', '.join(self.available()) or '(none)'}"
        )

    def create(self, name: str, /, **kwargs: Any) -> Any:
        """Instantiate a registered class by name with its config as keyword arguments.

        Raises:
            TypeError: a keyword the class does not take, named with the nearest one (a
                policy passing ``**kw`` to its base class would name the base class).
        """
        cls = self.get(name)
        accepted = accepted_keywords(cls)
        unknown = sorted(set(kwargs) - accepted) if accepted is not None else []
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(accepted or ()), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(
                f"{name!r} ({cls.__name__}) has no argument {unknown[0]!r}{hint}; it takes: "
                f"{', '.join(sorted(accepted or ())) or 'no arguments'}"
            )
        return cls(**kwargs)

    def available(self, kind: str | None = None) -> list[str]:
        """Sorted names; with ``kind`` only those of that kind (this imports plugins)."""
        self._discover()
        if kind is None:
            return sorted({*self._classes, *self._lazy})
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of {', '.join(KINDS)}")
        for name in list(self._lazy):
            self._load(name)
        return sorted(n for n, c in self._classes.items() if kind_of(c) == kind)

    def __contains__(self, name: object) -> bool:
        self._discover()
        return name in self._classes or name in self._lazy

    # --- entry points -------------------------------------------------------------------------
    def refresh(self) -> None:
        """Forget discovered entry points and scan again (after a plugin was installed)."""
        self._lazy.clear()
        self._discovered = self._group is None
        self._discover()

    def _discover(self) -> None:
        if self._discovered:
            return
        assert self._group is not None
        found: dict[str, md.EntryPoint] = {}
        for ep in md.entry_points(group=self._group):
            if ep.name in found and found[ep.name].value != ep.value:
                raise ValueError(
                    f"entry point name {ep.name!r} in group {self._group!r} is declared twice "
                    f"({found[ep.name].value!r} and {ep.value!r}); uninstall one plugin"
                )
            builtin = self._classes.get(ep.name)
            if builtin is not None:
                if _path(builtin) == ep.value:
                    continue  # the same class declared as a built-in and an entry point
                # Raised on every look-up until fixed: a silently shadowed plugin is worse.
                raise ValueError(
                    f"entry point {ep.name!r} = {ep.value!r} clashes with the already "
                    f"registered {_path(builtin)}; rename the entry point"
                )
            found[ep.name] = ep
        self._lazy.update(found)
        self._discovered = True

    def _load(self, name: str) -> type:
        ep = self._lazy[name]
        try:
            obj = ep.load()
        except (Exception, SystemExit) as exc:
            # SystemExit too: a module that parses the command line when imported (argparse
            # meets the app's overrides) or calls sys.exit ended every app at start-up,
            # where each installed plugin is imported, whichever one was asked for.
            raise PluginError(
                f"could not import plugin {name!r} = {ep.value!r} (entry-point group "
                f"{self._group!r}): {type(exc).__name__}: {exc}. Reinstall or uninstall "
                "the package that declares it"
            ) from exc
        try:
            kind_of(obj)
        except TypeError as exc:
            raise PluginError(f"plugin {name!r} = {ep.value!r}: {exc}") from exc
        # pop, not del: importing the plugin may already have registered it via @register.
        self._lazy.pop(name, None)
        self._classes[name] = obj
        return obj


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


REGISTRY = Registry()


def register(name: str | None = None, *, replace: bool = False) -> Callable[[type[T]], type[T]]:
    """Class decorator: ``@register("my_policy")``; without a name the class's ``name`` is used."""

    def decorate(cls: type[T]) -> type[T]:
        key = name or getattr(cls, "name", "")
        REGISTRY.register(key, cls, replace=replace)
        return cls

    return decorate


def get(name: str) -> type:
    """The class registered (or declared by an entry point) under ``name``."""
    return REGISTRY.get(name)


def create(name: str, /, **kwargs: Any) -> Any:
    """``get(name)(**kwargs)``."""
    return REGISTRY.create(name, **kwargs)


def available(kind: str | None = None) -> list[str]:
    """Names of all registered plugins, optionally of one kind (``interval``, ``placement``...)."""
    return REGISTRY.available(kind)


def refresh() -> None:
    """Rescan entry points, e.g. after ``pip install`` of a plugin in a running process."""
    REGISTRY.refresh()


def accepted_keywords(obj: Any) -> set[str] | None:
    """Every keyword a class accepts when its ``__init__`` passes ``**kw`` up the MRO (a
    policy's clamps go to its base class), or ``None`` when the chain ends open."""
    if not inspect.isclass(obj):
        return None
    accepted: set[str] = set()
    for cls in obj.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        if cls is object:
            return None
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):
            return None
        accepted |= {
            n
            for n, p in params.items()
            if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return accepted
    return None
