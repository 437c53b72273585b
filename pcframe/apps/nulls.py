"""``group=null`` on an app's command line, one value or one of a sweep's.

A config group whose default in the app's primary config is ``null`` (``policy/placement``
in ``pcframe-sim``, ``kernels`` and ``experiment`` in ``pcframe-run``) is documented with
``null`` as a value: nothing chosen. Hydra refuses ``group=null`` as an override, though
(``ValueError: Config group override must be a string or a list``, a traceback, in a sweep
after the first jobs had run). So every such group gets an option :data:`NONE`, an empty
config that changes nothing, and a ``null`` given to the group on the command line, alone
or in a sweep (``policy/placement=null,peers_then_remote``), is read as :data:`NONE`.

A group that must have a value (``policy/interval``) given ``null`` is refused before
Hydra starts, in one line naming the key and its options. A group only ``+group=option``
adds (``+sim/predictor=ewma``) may be left out too: ``+sim/predictor=null,ewma``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from importlib import resources

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from pcframe.errors import ConfigError

NONE = "none"
_PLAIN = re.compile(r"^[\w.\-]+$")  # an option name; anything fancier is left to Hydra
_NESTED_NULL = re.compile(r"(?<![\w.\-'\"])null(?![\w.\-'\"])", re.IGNORECASE)


def nullable_groups(app: str, groups: Sequence[str] = ()) -> list[str]:
    """The groups of ``app`` that may be left out: those ``conf/<app>.yaml``'s defaults list
    sets to ``null``, and those of its ``groups`` (all the app uses) that only a
    ``+group=option`` adds (``sim/predictor``)."""
    try:
        text = resources.files("pcframe.conf").joinpath(f"{app}.yaml").read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        return []
    defaults = OmegaConf.to_container(OmegaConf.create(text)).get("defaults") or []
    listed = {
        str(key).removeprefix("override ").strip("/"): value
        for entry in defaults
        if isinstance(entry, dict)
        for key, value in entry.items()
    }
    unlisted = [g for g in groups if g not in listed]
    return [g for g, value in listed.items() if value is None] + unlisted


def register_none_options(app: str, groups: Sequence[str] = ()) -> list[str]:
    """Store the empty option :data:`NONE` in each of ``app``'s nullable groups (``groups``:
    all the app uses); those groups. Idempotent."""
    nullable = nullable_groups(app, groups)
    store = ConfigStore.instance()
    for group in nullable:
        # package _global_ with nothing in it: merges nothing, as the null default
        store.store(group=group, name=NONE, node={}, package="_global_")
    return nullable


def read_nulls(
    overrides: Sequence[str],
    app: str,
    groups: Sequence[str] = (),
    options: Callable[[str], Mapping[str, list[str]]] | None = None,
) -> list[str]:
    """``overrides`` with ``null`` read as :data:`NONE` where a nullable group is given it
    (``policy/placement=null`` and each ``null`` of ``policy/placement=null,single_tier``).

    ``groups``: the app's config groups; one that may not be left out given ``null`` is a
    :class:`ConfigError` naming the key and its options (``options(app)``: every group's
    options, as ``pcframe.apps.errors.config_groups`` lists them). Overrides of keys (``a.b=null``),
    flags and values Hydra's grammar dresses up (``choice(...)``, quotes) pass unchanged.
    """
    nullable = set(nullable_groups(app, groups))
    out = []
    for override in overrides:
        sign, key, value = _parts(override)
        values = value.split(",") if value is not None else []
        if key is None:
            out.append(override)
            continue
        if not all(_PLAIN.match(v.strip()) for v in values):
            if (key in nullable or key in groups) and _NESTED_NULL.search(value or ""):
                # [null], choice(null,...): Hydra's TypeError or parse error, no key named
                raise ConfigError(
                    f"{override}: {key} takes null only as a plain value, alone or in a "
                    f"sweep list ({key}=null or {key}=null,<option>)"
                )
            out.append(override)
            continue
        nulls = [v.strip().lower() == "null" for v in values]
        if not any(nulls):
            out.append(override)
        elif key in nullable:
            chosen = [NONE if null else v for v, null in zip(values, nulls, strict=True)]
            out.append(f"{sign}{key}={','.join(chosen)}")
        elif key in groups:
            raise ConfigError(_must_choose(override, key, app, options))
        else:
            out.append(override)
    return out


def _parts(override: str) -> tuple[str, str | None, str | None]:
    """``(sign, group, value)`` of ``[+|++]group=value``; ``group`` None if not one."""
    if override.startswith(("-", "~")) or "=" not in override:
        return "", None, None
    key, _, value = override.partition("=")
    stripped = key.lstrip("+")
    sign = key[: len(key) - len(stripped)]
    key = stripped.strip("/")
    return sign, (key if "/" in key or "." not in key else None), value


def _must_choose(
    override: str,
    group: str,
    app: str,
    listing: Callable[[str], Mapping[str, list[str]]] | None,
) -> str:
    found = listing(app).get(group, []) if listing is not None else []
    options = [o for o in found if o != NONE]
    have = f"choose one of {', '.join(options)}" if options else "choose one of its options"
    return (
        f"{override}: {group} cannot be left out in pcframe-{app} (it has no null default); {have}"
    )
