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
import textwrap
import traceback
import warnings
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
from pcframe.errors import CheckpointError, ConfigError, DirectoryLocked, StateMismatch

USAGE_ERROR = 2  # exit code of a configuration mistake
INTERRUPTED = 130  # exit code after Ctrl-C (128 + SIGINT, as shells report it)
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
    "sim": ("sim/job", "policy/interval", "policy/resource", "policy/placement", "sim/predictor"),
}


_user_full_error = False  # HYDRA_FULL_ERROR=1 was set by the user, not by run_app


def run_app(app: Callable[[], Any], prog: str) -> None:
    """Run a ``@hydra.main`` function; report errors as described in the module docstring.

    Errors while Hydra composes the config arrive here; errors inside the task function are
    reported by :func:`reported` (which the apps wrap their body in), so that Hydra's
    "Error executing job" line does not precede the one line.
    """
    global _user_full_error
    if "--version" in sys.argv[1:]:
        # Hydra's own --version names Hydra, not the app a user asks about.
        print(version_lines(prog))
        raise SystemExit(0)
    from pcframe.apps.nulls import read_nulls, register_none_options

    name = _app_name(prog)
    groups = APP_GROUPS.get(name, ())
    register_none_options(name, groups)  # group=null: Hydra's ValueError traceback, in a sweep
    try:
        sys.argv[1:] = read_nulls(sys.argv[1:], name, groups, config_groups)
    except ConfigError as exc:
        _exit(exc, prog)
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
        # Hydra makes its output folder (hydra.run.dir, hydra.sweep.dir) and opens its log
        # file there before the task runs: a folder it cannot make or write is the user's
        # setting, not a bug.
        failed = _output_folder_error(exc)
        if failed is None:
            _exit(exc, prog)
        else:
            _exit_output_folder(failed, prog)
    except KeyboardInterrupt:  # Ctrl-C: the user's choice, not an error to trace back
        sys.stdout.flush()
        sys.stderr.write(
            f"{prog}: interrupted (Ctrl-C); what was committed stays (checkpoints, finished "
            "trials): run the same command again to go on\n"
        )
        raise SystemExit(INTERRUPTED) from None
    finally:
        os.environ.pop(FULL_ERROR, None)


def _output_folder_error(exc: BaseException) -> OSError | None:
    """The OSError of Hydra's own output folder or files under ``exc``, else ``None``.

    Hydra raises it as it is (the folder cannot be made), or, for its log file, wrapped by
    :mod:`logging.config` in a ``ValueError("Unable to configure handler 'file'")``: a
    folder that exists but cannot be written (read-only) came out as that traceback.
    """
    # Hydra's MissingConfigException is an OSError too (`engine=nosuch`): described with the
    # other configuration mistakes.
    if isinstance(exc, HydraException) or not _raised_by_hydra(exc):
        return None
    if isinstance(exc, OSError):
        return exc
    cause = exc.__cause__ or exc.__context__
    logging_handler = str(exc).startswith("Unable to configure handler")
    if isinstance(exc, ValueError) and logging_handler and isinstance(cause, OSError):
        return cause
    return None


def _exit_output_folder(exc: OSError, prog: str) -> None:
    innermost = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        innermost = frame.f_code.co_name
    where = f" {exc.filename}" if exc.filename else ""
    what = (
        f"cannot make Hydra's output folder{where}"
        if innermost in ("makedirs", "mkdir")
        else f"Hydra cannot write{where or ' in its output folder'}"  # its log file
    )
    sys.stderr.write(
        f"{prog}: error: {what}: {exc.strerror or exc}; set hydra.run.dir=PATH "
        "(hydra.sweep.dir=PATH with --multirun) to a folder you can write\n"
    )
    raise SystemExit(USAGE_ERROR) from None


def _raised_by_hydra(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc`` outside the standard library is Hydra's."""
    import hydra

    hydra_dir = os.path.dirname(hydra.__file__)
    stdlib_dir = os.path.dirname(os.__file__)
    innermost = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        filename = frame.f_code.co_filename
        if not filename.startswith(stdlib_dir) or "site-packages" in filename:
            innermost = filename
    return innermost is not None and innermost.startswith(hydra_dir)


def version_lines(prog: str) -> str:
    """``pcframe-run --version``: pcframe's version, then what it runs on (for bug reports)."""
    import platform

    import hydra
    import omegaconf

    from pcframe import __version__

    try:
        import torch

        torch_version = f", torch {torch.__version__}"
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_version = ""
    return (
        f"{prog} (pcframe) {__version__}\n"
        f"Hydra {hydra.__version__}, OmegaConf {omegaconf.__version__}{torch_version}, "
        f"Python {platform.python_version()}"
    )


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
    code, text = describe_error(exc, _app_name(prog))
    if text is None:
        traceback.print_exc()
        sys.stderr.write(f"{prog}: unexpected error (a bug: please report it)\n")
    else:
        sys.stderr.write(f"{prog}: error: {text}\n")
    sys.stdout.flush()
    raise SystemExit(code)


def _app_name(prog: str) -> str:
    """``run`` from ``pcframe-run``: the primary config's name."""
    return prog.removeprefix("pcframe-")


def describe_error(exc: BaseException, app: str | None = None) -> tuple[int, str | None]:
    """``(exit code, message)``; ``None`` as message for an unexpected error (a bug).

    ``app`` (``run``, ``sim``, ``tune``): the app whose config groups an advice may name
    (``policy=young`` -> ``policy/interval=young``); ``None``: every group.
    """
    from pcframe.policies.errors import TraceFormatError

    if isinstance(exc, ConfigError | TraceFormatError) or _is_sim_config_error(exc):
        return USAGE_ERROR, _flat(str(exc))
    if isinstance(exc, MissingConfigException):
        return USAGE_ERROR, _missing_option(exc, app)
    if isinstance(exc, OverrideParseException):
        first = _flat(exc.message.split("\n")[0])
        return USAGE_ERROR, (
            f"cannot parse the override {exc.override!r}: {first}; quote values with "
            "special characters, e.g. 'key=\"a b\"' (Hydra's override grammar)"
        )
    if isinstance(exc, ConfigCompositionException | InstantiationException):
        return USAGE_ERROR, _composition(exc, app)
    if isinstance(exc, OmegaConfBaseException):
        return USAGE_ERROR, _omegaconf(exc, app=app)
    if isinstance(exc, HydraException):
        return USAGE_ERROR, _flat(str(exc))
    if isinstance(exc, StateMismatch):
        return 1, _mismatch(exc)
    if isinstance(exc, DirectoryLocked):  # only one writer per folder: a usage mistake
        return USAGE_ERROR, _flat(str(exc))
    if isinstance(exc, CheckpointError):
        return 1, _flat(str(exc))
    called = _user_code_called_by_pcframe(exc)
    if called is not None:
        return 1, (
            f"{called} raised {type(exc).__name__}: {_flat(str(exc))[:300]}; that is the code "
            "of a plugin (a policy of your own), not pcframe's: fix it there "
            f"({FULL_ERROR}=1 shows the whole stack)"
        )
    return 1, None


_OURS = ("pcframe", "hydra", "omegaconf")  # the modules whose frames are not a plugin's


def _user_code_called_by_pcframe(exc: BaseException) -> str | None:
    """``module.function (file:line)`` of a policy's method outside pcframe that pcframe
    called on the way to ``exc`` (a plugin's ``decide``, ``observe``, ``load_state_dict``,
    ``target_interval``...); None if pcframe raised it itself, a library it calls (torch,
    numpy), or pcframe code the plugin called (its ``super().decide()``): a bug of ours to
    report with its traceback, not a plugin's."""
    stdlib = os.path.dirname(os.__file__)
    caller_is_ours, plugin = False, None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        module = str(frame.f_globals.get("__name__", ""))
        if module.split(".")[0] in _OURS:
            if plugin is not None:  # pcframe's code again, deeper (a plugin's super().decide())
                return None
            caller_is_ours = True
            continue
        filename = frame.f_code.co_filename
        if filename.startswith(stdlib) and "site-packages" not in filename:
            continue  # contextlib, functools: between pcframe and what it called
        if plugin is None and caller_is_ours and _is_policy(frame.f_locals.get("self")):
            plugin = f"{module}.{frame.f_code.co_qualname} ({filename}:{line})"
        caller_is_ours = False
    return plugin


def _is_policy(obj: Any) -> bool:
    """Whether ``obj`` answers as an interval, resource or placement policy does."""
    return obj is not None and any(
        callable(getattr(obj, name, None)) for name in ("decide", "observe", "target_interval")
    )


def error_text(exc: BaseException, advice: bool = True) -> str:
    """``exc``'s message on one line (the ``pcframe`` CLI has its own, ``pcframe.text.one_line``,
    so that it never imports Hydra): a :class:`StateMismatch` as its first few mismatches,
    with its closing advice unless ``advice=False`` (where the caller gives the app's fix:
    the library's, ``restore(strict=False)``, means nothing to an app's user)."""
    if isinstance(exc, StateMismatch):
        return _mismatch(exc, advice=advice)
    return _flat(str(exc))


def _mismatch(exc: StateMismatch, shown: int = 3, advice: bool = True, width: int = 160) -> str:
    """A :class:`StateMismatch` (a line, then one line per mismatch) on one line; each
    mismatch cut to ``width`` characters (a model's missing keys run to thousands)."""
    head = str(exc).split("\n", 1)[0].rstrip(":")
    problems = [textwrap.shorten(p, width, placeholder=" ...") for p in exc.mismatches[:shown]]
    more = len(exc.mismatches) - len(problems)
    listed = "; ".join(problems) + (f"; and {more} more" if more > 0 else "")
    hint = str(exc).rstrip().rsplit("\n", 1)[-1] if "\n" in str(exc) else ""
    tail = f". {hint}" if advice and hint and not hint.lstrip().startswith("-") else ""
    return _flat(f"{head}: {listed}{tail}")


def _is_sim_config_error(exc: BaseException) -> bool:
    from pcframe.errors import SimConfigError

    return isinstance(exc, SimConfigError)


def _flat(text: str) -> str:
    """Lines joined into one (Hydra and OmegaConf messages span several)."""
    parts = [p.strip() for p in text.strip().splitlines() if p.strip()]
    return " ".join(parts)


def _omegaconf(
    exc: OmegaConfBaseException, override: str | None = None, app: str | None = None
) -> str:
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
        # A top-level name given a group's option (interval=young, polcy=young): the group.
        group = _group_for(name, given_value, app) if not parent and has_value else None
        hint = (
            f"did you mean {group}? (a config group: group=option)"
            if group
            else f"did you mean {parent + '.' if parent else ''}{close[0]}?"
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


def _composition(exc: HydraException, app: str | None = None) -> str:
    text = str(exc)
    cause = exc.__cause__
    not_in_defaults = re.search(
        r"Could not override '([^']+)'\. No match in the defaults list.*use \+(\S+)", text, re.S
    )
    if not_in_defaults:  # Hydra's advice (append it with +) is wrong for pcframe's groups
        advice = group_advice(not_in_defaults.group(2), app)
        if advice:
            return advice
    match = re.search(r"override (\S+=\S*)", text) or re.search(r"override '([^']+)'", text)
    override = match.group(1) if match else None
    if isinstance(cause, OmegaConfBaseException):
        if override and "=" not in override:  # "Could not override 'key'." + "+key=value"
            plus = re.search(r"use \+(\S+)", text)
            override = plus.group(1) if plus else override
        return _omegaconf(cause, override, app)
    line = _flat(text)
    if cause is not None and str(cause).strip():
        line += f" ({_flat(str(cause))})"
    return line


def _missing_option(exc: MissingConfigException, app: str | None = None) -> str:
    missing = exc.missing_cfg_file or ""
    group, _, option = missing.rpartition("/")
    options = [o for o in (exc.options or []) if not o.endswith("_schema")]
    if not group:  # the primary config itself
        return _flat(str(exc).split("\n")[0])
    if not options:  # +policy=young: `policy` holds groups, not options
        advice = group_advice(f"{group}={option}", app)
        if advice:
            return advice
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


# --- config groups: the advice for group=option mistakes -----------------------------------


@contextlib.contextmanager
def _config_loader() -> Iterator[Any]:
    """Hydra's config loader: the running app's, or one over the installed configs."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        yield GlobalHydra.instance().config_loader()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. an absent $PCFRAME_CONFIG_DIR
        with initialize_config_module("pcframe.conf", version_base="1.3"):
            yield GlobalHydra.instance().config_loader()


def config_groups(app: str | None = None) -> dict[str, list[str]]:
    """Every config group that has options -> its options (schemas left out), as Hydra finds
    them for ``app``'s primary config (installed configs, ``$PCFRAME_CONFIG_DIR``, plugins).

    ``{}`` if they cannot be listed: the callers then keep Hydra's own message.
    """
    found: dict[str, list[str]] = {}
    try:
        with _config_loader() as loader:

            def options(group: str) -> list[str]:
                if app is not None:
                    with contextlib.suppress(Exception):
                        return loader.get_group_options(group, config_name=app)
                return loader.get_group_options(group)

            def walk(parent: str) -> None:
                for name in sorted(loader.list_groups(parent)):
                    group = f"{parent}/{name}" if parent else name
                    if group == "hydra":
                        continue
                    shown = sorted(o for o in options(group) if not o.endswith("_schema"))
                    if shown:
                        found[group] = shown
                    walk(group)

            walk("")
    except Exception:  # never let the advice replace the error it explains
        return {}
    return found


def _used_groups(app: str | None, groups: dict[str, list[str]]) -> list[str]:
    return [g for g in APP_GROUPS.get(app or "", list(groups)) if g in groups]


def _users(group: str) -> list[str]:
    return [f"pcframe-{app}" for app, used in APP_GROUPS.items() if group in used]


def _options_text(group: str, groups: dict[str, list[str]]) -> str:
    return f"{group} ({', '.join(groups[group])})"


def group_advice(override: str, app: str | None = None) -> str | None:
    """One line for ``key=value`` where ``key`` is no config group of ``app``'s defaults list.

    Hydra says "append it with +key=value", which is wrong where ``key`` is a folder of
    groups (``policy=young``: ``policy/interval=young``), a group another app uses
    (``pcframe-run policy/resource=spot_only``) or a typo. ``None``: nothing better to say.
    """
    key, _, value = override.lstrip("+~").partition("=")
    key = key.strip("/")
    groups = config_groups(app)
    if not groups:
        return None
    used = _used_groups(app, groups)
    prog = f"pcframe-{app}" if app else "this app"
    if key in groups:  # a real group, just not one this app composes
        if key in used:
            return None
        users = _users(key)
        by = f" ({' and '.join(users)} uses it; {prog} would ignore it)" if users else ""
        return (
            f"{key}={value}: {prog} has no {key} group{by}; its groups are "
            f"{', '.join(used)}; to add it anyway: +{key}={value}"
        )
    below = [g for g in groups if g.startswith(f"{key}/")]
    related = below + [g for g in groups if g.rsplit("/", 1)[-1] == key and g not in below]
    if not related:
        return None
    what = (
        f"{key} is not a config group but a folder of groups ({', '.join(below)})"
        if below
        else f"{key} is not a config group"
    )
    fits = [g for g in related if g in used and value in groups[g]]
    if len(fits) == 1:
        return f"{what}; {value} is a {fits[0]} option: give {fits[0]}={value}"
    mine = [g for g in related if g in used]
    elsewhere = [g for g in related if g not in used and value in groups[g]]
    if elsewhere and mine:
        users = " and ".join(u for g in elsewhere for u in _users(g)) or "another app"
        return (
            f"{what}; {value} is a {' and '.join(elsewhere)} option, which {prog} does not "
            f"use ({users} does); {prog}'s: " + "; ".join(_options_text(g, groups) for g in mine)
        )
    if not mine:
        return (
            f"{what}, and {prog} uses none of {', '.join(related)}; "
            f"its groups are {', '.join(used)}"
        )
    near = [
        (g, close[0]) for g in mine if (close := difflib.get_close_matches(value, groups[g], n=1))
    ]
    example = f"; did you mean {near[0][0]}={near[0][1]}?" if near else ""
    return (
        f"{what}: pick an option of "
        + "; ".join(_options_text(g, groups) for g in mine)
        + f" as group=option, e.g. {mine[0]}={groups[mine[0]][0]}{example}"
    )


def _group_for(name: str, value: str, app: str | None) -> str | None:
    """``group=option`` for a top-level name that is no key but meant a group of ``app``:
    the one group with the option ``value`` (``interval=young``, ``wrkload=gpt``), or the
    group named ``name`` (``predictor=x``: ``sim/predictor=<one of ...>``); else ``None``."""
    if not re.fullmatch(r"[\w.-]*", value or ""):
        return None
    groups = config_groups(app)
    used = _used_groups(app, groups)
    having = [g for g in used if value and value in groups[g]]
    if len(having) == 1:
        return f"{having[0]}={value}"
    named = [g for g in used if g.rsplit("/", 1)[-1] == name]
    if len(named) == 1:
        return f"{named[0]}=<one of: {', '.join(groups[named[0]])}>"
    return None


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
