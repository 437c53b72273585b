"""Shared bits of the simulator experiments: where results go, how they are stamped."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
import results_file
from results_file import command_line, stamp, write_results

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "experiments" / "results"
# Trace sources grouped into the families the result tables report.
FAMILIES = {
    "skynomad-aws-v100-availability": "V100 zones (6, 45 d)",
    "skynomad-aws-v100-4node": "V100 4/16 nodes (2)",
    "skynomad-aws-v100-16node": "V100 4/16 nodes (2)",
    "bamboo": "Bamboo + PCcheck (3)",
    "pccheck": "Bamboo + PCcheck (3)",
    "skynomad-gcp-h100": "H100 zones (9, 15 d)",
}

__all__ = ["FAMILIES", "REPO", "RESULTS", "csv_header", "header", "write_results"]


def header(title: str, extra: str = "") -> str:
    """Markdown preamble: title, the command that made the file, the machine; then
    ``extra`` as a paragraph."""
    text = "\n".join(results_file.header(title, command_line())) + "\n"
    return text + (extra + "\n\n" if extra else "")


def csv_header() -> str:
    """Comment lines at the top of a CSV: the command that made it and the machine."""
    return f"regenerate with: {command_line()}\n{stamp()}"
