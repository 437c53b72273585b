"""One-line errors for the Hydra apps, and their ``--help`` group listings.

:func:`run_app` runs a ``@hydra.main`` function so that a configuration mistake (a misspelt
key, a value of the wrong type or out of range, an option that does not exist) ends the
process with **one line** on stderr naming the key and the fix, and exit code 2, the
convention of command-line tools for usage errors. Other pcframe errors print their message
and exit 1; anything else is a bug and keeps its traceback. ``HYDRA_FULL_ERROR=1`` shows the
whole stack of every error, as Hydra documents.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from hydra.errors import (
    ConfigCompositionException,
    HydraException,
    InstantiationException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from pcframe.apps.paths import user_config_dir
from pcframe.errors import CheckpointError, ConfigError

USAGE_ERROR = 2  # exit code of a configuration mistake
FULL_ERROR = "HYDRA_FULL_ERROR"

# The config groups each app uses (what its --help lists, in this order).
APP_GROUPS = {
    "run": (
        "workload",
        "engine",
        "kernels",
        "storage",
        "policy/interval",
        "failure",
        "experiment",
    ),
    "tune": ("tune", "workload", "engine", "kernels", "storage"),
    "sim": ("sim/job", "policy/interval", "policy/resource", "sim/predictor"),
}


_user_full_error = False  # HYDRA_FULL_ERROR=1 was set by the user, not by run_app


def run_app(app: Callable[[], Any], prog: str) -> None:
    """Run a ``@hydra.main`` function; report errors as described in the module docstring.

    Errors while Hydra composes the config arrive here; errors inside the task function are
    reported by :func:`reported` (which the apps wrap their body in), so that Hydra's
    "Error executing job" line does not precede the one line.
    """
    global _user_full_error
    if os.environ.get(FULL_ERROR) == "1":
        _user_full_error = True
        app()
        return
    os.environ[FULL_ERROR] = "1"  # Hydra then re-raises instead of printing a trimmed stack
    try:
        app()
    except BrokenPipeError:  # `pcframe-run --help | head`: the reader left, nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(1) from None
    except Exception as exc:
        _exit(exc, prog)
    finally:
        os.environ.pop(FULL_ERROR, None)


@contextlib.contextmanager
def reported(prog: str) -> Iterator[None]:
    """Inside a task function: report a known error in one line and exit (2: config)."""
    try:
        yield
    except Exception as exc:
        if _user_full_error or describe_error(exc)[1] is None:
            raise
        _exit(exc, prog)


def _exit(exc: BaseException, prog: str) -> None:
    code, text = describe_error(exc)
    if text is None:
        traceback.print_exc()
        sys.stderr.write(f"{prog}: unexpected error (a bug: please report it)\n")
    else:
        sys.stderr.write(f"{prog}: error: {text}\n")
    sys.stdout.flush()
    raise SystemExit(code)


def describe_error(exc: BaseException) -> tuple[int, str | None]:
    """``(exit code, message)``; ``None`` as message for an unexpected error (a bug)."""
    from pcframe.policies.errors import TraceFormatError

    if isinstance(exc, ConfigError | TraceFormatError) or _is_sim_config_error(exc):
        return USAGE_ERROR, _flat(str(exc))
    if isinstance(exc, MissingConfigException):
        return USAGE_ERROR, _missing_option(exc)
    if isinstance(exc, OverrideParseException):
        first = _flat(exc.message.split("\n")[0])
        return USAGE_ERROR, (
            f"cannot parse the override {exc.override!r}: {first}; quote values with "
            "special characters, e.g. 'key=\"a b\"' (Hydra's override grammar)"
        )
    if isinstance(exc, ConfigCompositionException | InstantiationException):
        return USAGE_ERROR, _composition(exc)
    if isinstance(exc, OmegaConfBaseException):
        return USAGE_ERROR, _omegaconf(exc)
    if isinstance(exc, HydraException):
        return USAGE_ERROR, _flat(str(exc))
    if isinstance(exc, CheckpointError):
        return 1, str(exc)
    return 1, None


def _is_sim_config_error(exc: BaseException) -> bool:
    from pcframe.errors import SimConfigError

    return isinstance(exc, SimConfigError)


def _flat(text: str) -> str:
    """Lines joined into one (Hydra and OmegaConf messages span several)."""
    parts = [p.strip() for p in text.strip().splitlines() if p.strip()]
    return " ".join(parts)


def _omegaconf(exc: OmegaConfBaseException, override: str | None = None) -> str:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
    msg = str(getattr(exc, "msg", None) or exc).split("\n")[0].strip()
    given_key, has_value, given_value = (override or "").partition("=")
    given_key = given_key.lstrip("+~")
    if isinstance(exc, ConfigKeyError | AttributeError) and " not in " in msg:
        if given_value.strip().startswith("{") and str(key).startswith(f"{given_key}."):
            # A whole mapping given for a dict whose keys it adds: Hydra merges it key by key.
            return (
                f"{given_key}={given_value} adds keys to {given_key}; a mapping given whole "
                f"needs the + prefix: +{given_key}={given_value}"
            )
        parent, _, name = str(key).rpartition(".")
        fields = _fields(getattr(exc, "object_type", None)) or _keys(exc)
        close = difflib.get_close_matches(name, fields, n=1)
        where = f" of {parent}" if parent else ""
        hint = (
            f"did you mean {parent + '.' if parent else ''}{close[0]}?"
            if close
            else "see the keys with --cfg job"
        )
        value = given_value if has_value else "..."
        return f"{key} is not a key{where}; {hint} (to add a new key anyway: +{key}={value})"
    if isinstance(exc, ValidationError):
        wanted = _wanted(msg)
        shown = f"{key}={given_value}" if has_value else str(key)
        return f"{shown} is invalid: {msg}{'; give ' + wanted if wanted else ''}"
    if "Cannot merge DictConfig with ListConfig" in msg:
        return f"{key} is a mapping, not a list: give it as {{key: value, ...}}"
    return f"{key}: {msg}"


def _wanted(msg: str) -> str:
    for name, text in (
        ("Integer", "a whole number"),
        ("Float", "a number"),
        ("Boolean", "true or false"),
        ("Union", "a value of one of those types"),
    ):
        if name in msg:
            return text
    return ""


def _fields(object_type: Any) -> list[str]:
    if object_type is not None and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type)]
    return []


def _keys(exc: OmegaConfBaseException) -> list[str]:
    """The keys of an untyped node (a policy's ``_target_`` config), Hydra's left out."""
    parent = getattr(exc, "parent_node", None)
    if isinstance(parent, DictConfig):
        return [str(k) for k in parent if not str(k).startswith("_")]
    return []


def _composition(exc: HydraException) -> str:
    text = str(exc)
    cause = exc.__cause__
    match = re.search(r"override (\S+=\S*)", text) or re.search(r"override '([^']+)'", text)
    override = match.group(1) if match else None
    if isinstance(cause, OmegaConfBaseException):
        if override and "=" not in override:  # "Could not override 'key'." + "+key=value"
            plus = re.search(r"use \+(\S+)", text)
            override = plus.group(1) if plus else override
        return _omegaconf(cause, override)
    line = _flat(text)
    if cause is not None and str(cause).strip():
        line += f" ({_flat(str(cause))})"
    return line


def _missing_option(exc: MissingConfigException) -> str:
    missing = exc.missing_cfg_file or ""
    group, _, option = missing.rpartition("/")
    options = [o for o in (exc.options or []) if not o.endswith("_schema")]
    if not group:  # the primary config itself
        return _flat(str(exc).split("\n")[0])
    user = user_config_dir()
    state = "" if user.is_dir() else ", which does not exist"
    have = f" (have: {', '.join(options)})" if options else ""
    line = (
        f"{group}={option}: no such option{have}; {group} options are looked up in the "
        f"installed pcframe.conf and in $PCFRAME_CONFIG_DIR ({user}{state})"
    )
    if group.startswith(("policy/", "sim/predictor")):
        from pcframe.apps.plugins import broken_plugins

        why = broken_plugins().get(option)
        line += (
            f"; the plugin {option!r} is installed but failed: {_flat(why)}"
            if why
            else "; a policy installed through the 'pcframe.policies' entry point is an "
            "option by its registry name (pcframe.policies.available())"
        )
    if group == "engine":
        line += (
            "; pcframe-tune writes engine/tuned.yaml there, relative to the folder it ran "
            "in: run from that folder, or set PCFRAME_CONFIG_DIR to its pcframe-conf"
        )
    return line


# --- --help --------------------------------------------------------------------------------


def help_groups(app: str) -> str:
    """The ``group: option, ...`` lines of ``app``'s groups (an OmegaConf resolver).

    Hydra's own ``$APP_CONFIG_GROUPS`` lists every group of the shared config folder, the
    other apps' included, and the schemas stored beside the options (``engine_schema``).
    """
    from hydra.core.global_hydra import GlobalHydra

    loader = (
        GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    )
    lines = []
    for group in APP_GROUPS.get(app, ()):
        options: list[str] = []
        if loader is not None:
            try:
                options = loader.get_group_options(group, config_name=app)
            except Exception:  # never let --help fail over the listing
                options = []
        shown = sorted(o for o in options if not o.endswith("_schema"))
        lines.append(f"  {group}: {', '.join(shown)}")
    return "\n".join(lines)


def register_resolvers() -> None:
    """``${pcframe_groups:<app>}`` for the apps' help templates (idempotent)."""
    if not OmegaConf.has_resolver("pcframe_groups"):
        OmegaConf.register_new_resolver("pcframe_groups", help_groups, use_cache=False)
