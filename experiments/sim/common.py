"""Shared bits of the simulator experiments: where results go, how they are stamped."""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

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


def command() -> str:
    """The command line that regenerates a result (written at the top of every file)."""
    args = " ".join(sys.argv[1:])
    script = Path(sys.argv[0]).resolve().relative_to(REPO)
    return f"python {script} {args}".strip()


def stamp() -> str:
    return (
        f"generated {time.strftime('%Y-%m-%d %H:%M')} on {platform.node() or 'host'}: "
        f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"
    )


def header(title: str, extra: str = "") -> str:
    """Markdown preamble: title, the command that made the file, the machine."""
    text = f"# {title}\n\nRegenerate with:\n\n```bash\n{command()}\n```\n\n_{stamp()}_\n\n"
    return text + (extra + "\n\n" if extra else "")


def csv_header() -> str:
    """Comment lines at the top of a CSV: the command that made it and the machine."""
    return f"regenerate with: {command()}\n{stamp()}"
