"""The experiments' Markdown results files: one header, one table writer, one file writer.

A script makes its results file whole and writes it with :func:`write_results`, which
replaces the file atomically (a temporary file beside it, then a rename) and **keeps the
history**: every section of the file already there whose heading starts with
:data:`KEEP` (``"## Earlier runs"``, e.g. ``## Earlier runs and notes (moved from the
README)``) is copied after the new text, word for word. A section runs from its heading to
the next ``#`` or ``##`` heading outside a code fence, or to the end of the file. So notes
on earlier runs go under such a heading, and a rerun of the script replaces only its own
text above them.

The tables: :func:`table_lines` takes cells the script has already formatted (e.g.
``"0.030 (0.028..0.031)"``) and says per column how to align them. For rows of plain
numbers in dicts, :func:`pcframe.sim.report.markdown_table` formats the numbers and
aligns them itself (the simulator's scripts use that one).

The scripts live in subdirectories and run as ``python experiments/<dir>/<script>.py``;
they import this module after putting ``experiments/`` on ``sys.path``::

    sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
    from results_file import header, table_lines, write_results
"""

from __future__ import annotations

import contextlib
import os
import platform
import stat
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from pcframe.text import markdown_cell

KEEP = "## Earlier runs"
"""Sections of a results file whose heading starts with this survive a rerun."""

ALIGN = {"l": "---", "r": "---:", "c": ":---:"}
REPO = Path(__file__).resolve().parents[1]


def command_line() -> str:
    """This process's command line as ``python <script> <args>``, the script's path
    relative to the repository (as given where it lies outside)."""
    script = Path(sys.argv[0])
    with contextlib.suppress(ValueError):
        script = script.resolve().relative_to(REPO)
    return " ".join(["python", script.as_posix(), *sys.argv[1:]]).strip()


def stamp() -> str:
    """When and where: ``generated <date> on <host>: <arch>, Python <v>, torch <v>``."""
    text = (
        f"generated {time.strftime('%Y-%m-%d %H:%M')} on {platform.node() or 'host'}: "
        f"{platform.machine()}, Python {platform.python_version()}"
    )
    try:
        import torch
    except ImportError:
        return text
    return f"{text}, torch {torch.__version__}"


def header(title: str, command: str, note: str = "") -> list[str]:
    """A results file's first lines: ``# title``, the command that made it, the
    :func:`stamp` (and ``; note`` after it) in italics, then an empty line."""
    when = stamp() + (f"; {note}" if note else "")
    return [f"# {title}", "", f"Command: `{command}`", "", f"_{when}_", ""]


def table_lines(
    headers: Sequence[str], rows: Iterable[Sequence[object]], align: str = ""
) -> list[str]:
    """A Markdown table, one line per string: ``headers``, then one line per row of cells
    (``str()`` of each). ``align`` has a letter per column, ``l``, ``r`` or ``c``; columns
    past its end are left-aligned."""
    align = align.ljust(len(headers), "l")
    lines = [_row(headers), "|" + "|".join(ALIGN[a] for a in align[: len(headers)]) + "|"]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(headers):
            raise ValueError(f"{len(cells)} cells for {len(headers)} columns: {cells}")
        lines.append(_row(cells))
    return lines


def _row(cells: Sequence[str]) -> str:
    """One row; a ``|`` or a newline in a cell stays in it (:func:`pcframe.text.markdown_cell`)."""
    return "|" + "|".join(f" {markdown_cell(c)} " if c else " " for c in cells) + "|"


def kept_sections(text: str) -> list[str]:
    """The sections of ``text`` that :func:`write_results` keeps (see :data:`KEEP`), each
    from its heading line on, trailing empty lines dropped, in the order of the file."""
    sections: list[list[str]] = []
    keeping = fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if not fenced and (line.startswith("# ") or line.startswith("## ")):
            keeping = line.startswith(KEEP)
            if keeping:
                sections.append([])
        if keeping:
            sections[-1].append(line)
    return ["\n".join(lines).rstrip() + "\n" for lines in sections]


def write_results(path: str | Path, text: str) -> str:
    """Replace ``path`` with ``text`` and the :data:`KEEP` sections of the file there now
    (not the ones whose heading line ``text`` has itself); atomically, the directory made
    if missing. Returns what was written."""
    path = Path(path)
    exists = path.is_file()
    old = path.read_text() if exists else ""
    ours = set(text.splitlines())
    kept = [s for s in kept_sections(old) if s.splitlines()[0] not in ours]
    whole = text if text.endswith("\n") else text + "\n"
    if kept:
        whole = whole.rstrip("\n") + "\n\n" + "\n".join(kept)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(whole)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode) if exists else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return whole
