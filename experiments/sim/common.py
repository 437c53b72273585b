"""Shared bits of the simulator experiments: where results go, how they are stamped."""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "experiments" / "results"


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
