"""Print per-trace statistics as a Markdown table: ``python -m pcframe.policies.traces [DIR]``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from pcframe.policies.traces import load_traces, shared_traces_dir, trace_files


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
            f"| {s.source} | {s.name} | {s.ticks} × {s.step_seconds:.0f} s | {s.hours:.1f} "
            f"| {s.capacity} {t.unit} | {s.availability:.3f} | {s.preemptions} "
            f"| {s.instances_lost:g} | {h(s.mtbf)} | {h(s.instance_mtbf)} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else shared_traces_dir()
    if root is None or not trace_files(root):
        print("no traces found: pass a directory or set PCFRAME_TRACES", file=sys.stderr)
        return 1
    print(table(root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
