"""Which traces a ``traces=`` setting names: ``all`` (the shipped ones), a file, a folder or
a glob, relative to the working directory or the shipped traces folder."""

from __future__ import annotations

import glob
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
    shipped = shared_traces_dir()
    if spec == "all":
        if shipped is None:
            raise SimConfigError(
                "traces=all but no shipped traces were found; set $PCFRAME_TRACES to a "
                "folder of traces or give traces=<file|folder|glob>"
            )
        return load_traces(shipped, **options)
    bases = [Path(cwd or Path.cwd())] + ([shipped] if shipped is not None else [])
    for base in bases:
        pattern = str(Path(spec) if Path(spec).is_absolute() else base / spec)
        matches = sorted(glob.glob(pattern, recursive=True))
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
            # a malformed file raises TraceFormatError
            return [load_trace(f, **options) for f in files]
    where = ", ".join(str(b) for b in bases)
    raise SimConfigError(
        f"traces={spec!r} matched no trace file (looked in {where}); give 'all', a trace "
        "file, a folder or a glob such as 'skynomad/gcp-h100-16-2025/*.json'"
    )
