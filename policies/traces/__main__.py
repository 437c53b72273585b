"""Print per-trace statistics as a Markdown table: ``python -m pcframe.policies.traces [DIR]``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from pcframe.policies.traces import (
    ENV_VAR,
    TraceFormatError,
    load_traces,
    shared_traces_dir,
    trace_files,
)
from pcframe.text import markdown_row, one_line


def table(root: Path) -> str:
    rows = [
        "| source | trace | ticks × step | hours | capacity | availability | preemptions "
        "| VMs lost | MTBF (h) | per-VM MTBF (h) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in load_traces(root):
        s = t.stats()

        def h(x: float) -> str:
            return "∞" if math.isinf(x) else f"{x / 3600:.2f}"

        rows.append(
            markdown_row(
                [
                    s.source,
                    s.name,
                    f"{s.ticks} × {s.step_seconds:.0f} s",
                    f"{s.hours:.1f}",
                    f"{s.capacity} {t.unit}",
                    f"{s.availability:.3f}",
                    s.preemptions,
                    f"{s.instances_lost:g}",
                    h(s.mtbf),
                    h(s.instance_mtbf),
                ]
            )
        )
    return "\n".join(rows)


PROG = "python -m pcframe.policies.traces"
USAGE = (
    f"usage: {PROG} [PATH]: PATH is a trace file or a folder of them (default: the shipped "
    f"traces, ${ENV_VAR} or experiments/traces)"
)


def main(argv: list[str]) -> int:
    """Print the table: 0 when done, 1 when a trace cannot be read (one line, naming the file
    and the fix), 2 on a wrong command line. Never a traceback."""
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        what = "more than one PATH" if len(argv) > 1 else f"unknown option {argv[0]!r}"
        print(f"{PROG}: {one_line(what)}; {USAGE}", file=sys.stderr)
        return 2
    try:
        root = Path(argv[0]) if argv else shared_traces_dir()
        if root is not None and not root.exists():
            print(
                f"{PROG}: {one_line(repr(str(root)))} is neither a trace file nor a folder "
                "of them; pass the path of one (a trace is given by its file, not its name)",
                file=sys.stderr,
            )
            return 1
        if root is None or not trace_files(root):
            where = "" if root is None else f" in {one_line(repr(str(root)))}"
            print(
                f"{PROG}: no trace files (*.csv, *.json){where}; pass a trace file or a folder "
                f"of them, or set ${ENV_VAR}",
                file=sys.stderr,
            )
            return 1
        print(table(root))
    except (TraceFormatError, OSError) as exc:  # names the file and, for a format, the fix
        print(f"{PROG}: {one_line(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug, not the input: still one line
        print(
            f"{PROG}: internal error: {type(exc).__name__}: {one_line(exc)} (please report it)",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
