"""Which traces a ``traces=`` setting names: ``all`` (the shipped ones), a file, a folder or
a glob, relative to the working directory or the shipped traces folder."""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pcframe.errors import SimConfigError
from pcframe.policies.traces import (
    Trace,
    is_trace_file,
    load_trace,
    load_traces,
    shared_traces_dir,
    trace_files,
)


def select_traces(spec: str, cwd: str | Path | None = None, **options: Any) -> list[Trace]:
    """Traces named by ``spec``: ``all`` (the shipped ones), a file, a folder or a glob.

    Relative paths are tried against ``cwd`` first, then the shipped traces folder;
    ``options`` go to :func:`~pcframe.policies.traces.load_trace` (``convention``,
    ``capacity``, ``step_seconds``).
    """
    if not str(spec).strip():  # "" would name the working directory itself
        raise SimConfigError(
            "traces='' names no trace; give traces=all, a file, a folder or a glob"
        )
    try:
        shipped, unusable = shared_traces_dir(), ""
    except FileNotFoundError as exc:
        # $PCFRAME_TRACES names no folder: one line, and a trace named by its own path
        # still loads (this was a raw traceback whatever traces= said)
        shipped, unusable = None, f"; {exc}"
    if spec == "all":
        if shipped is None:
            raise SimConfigError(
                "traces=all but no shipped traces were found; set $PCFRAME_TRACES to a "
                f"folder of traces or give traces=<file|folder|glob>{unusable}"
            )
        return load_traces(shipped, **options)
    bases = [Path(cwd or Path.cwd())] + ([shipped] if shipped is not None else [])
    for base in bases:
        pattern = str(Path(spec) if Path(spec).is_absolute() else base / spec)
        matches = sorted(_glob(pattern))
        # Every folder matched (its traces as load_traces finds them) and every file: a file
        # named outright is loaded whatever it is, one a wildcard matched only if it is a
        # trace (not a licence or a price table).
        wild = glob.has_magic(spec)
        files = sorted(
            {
                f
                for m in map(Path, matches)
                for f in (trace_files(m) if m.is_dir() else [m])
                if f.is_file() and (not wild or is_trace_file(f))
            }
        )
        if files:
            # One file reached by two paths (a link to a folder beside it) is one trace.
            seen: set[Path] = set()
            unique = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]
            # a malformed file raises TraceFormatError
            return [load_trace(f, **options) for f in unique]
    where = ", ".join(str(b) for b in bases)
    raise SimConfigError(
        f"traces={spec!r} matched no trace file (looked in {where}); give 'all', a trace "
        f"file, a folder or a glob such as 'skynomad/gcp-h100-16-2025/*.json'{unusable}"
    )


def _glob(pattern: str) -> Iterator[str]:
    """``glob.glob(pattern, recursive=True)``, but a ``**`` enters each real folder once.

    ``glob`` follows links to folders under ``**`` without end: a link to ``..`` inside the
    traces folder listed every trace once per level (40 levels, until the kernel refused the
    path), and two such links made 2**40 paths, a run that never started.
    """
    if not glob.has_magic(pattern):
        if os.path.lexists(pattern):
            yield pattern
        return
    parts = Path(pattern).parts
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    yield from _match(Path(*parts[:fixed]) if fixed else Path("."), parts[fixed:], set())


def _match(
    folder: Path, parts: tuple[str, ...], seen: set[tuple[int, int, int]], top: bool = True
) -> Iterator[str]:
    """Paths under ``folder`` matching ``parts`` (``seen``: the folders ``**`` entered;
    ``top``: ``folder`` is where ``**`` starts, named with a trailing separator as glob does)."""
    head, rest = parts[0], parts[1:]
    if head == "**":
        try:
            st = folder.stat()
        except OSError:
            return
        walked = (st.st_dev, st.st_ino, len(parts))  # by this `**` of the pattern
        if walked in seen:  # a loop of links: this folder was walked
            return
        seen.add(walked)
        if rest:
            yield from _match(folder, rest, seen)
        else:
            yield str(folder) + os.sep if top else str(folder)
        for child in _children(folder, "*"):
            if child.is_dir():
                yield from _match(child, parts, seen, top=False)
            elif not rest:
                yield str(child)
        return
    names = _children(folder, head) if glob.has_magic(head) else [folder / head]
    for child in names:
        if not rest:
            if os.path.lexists(child):
                yield str(child)
        elif child.is_dir():
            yield from _match(child, rest, seen)


def _children(folder: Path, pattern: str) -> list[Path]:
    """Entries of ``folder`` matching one component (hidden ones only if it names them)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    if not pattern.startswith("."):
        names = [n for n in names if not n.startswith(".")]
    return [folder / n for n in sorted(fnmatch.filter(names, pattern))]
