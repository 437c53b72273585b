"""``pcframe-sim``: simulate a checkpointed training job over spot traces (a Hydra app).

One run simulates the configured interval (and resource) policy, plus the baselines, on
every selected trace and writes ``results.csv`` (plain CSV), ``results.meta.json`` (the
command and what each column means), ``results.md`` (with a legend) and plots into Hydra's
output folder; ``--multirun`` sweeps also get merged results in the sweep folder. The
terminal table shows the columns that fit the terminal, never cut, with a legend. See
``conf/sim.yaml`` and docs/simulator.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table
from rich.text import Text

from pcframe.apps.errors import register_resolvers, reported, run_app
from pcframe.apps.instantiate import check_targets
from pcframe.apps.plugins import register_policy_configs
from pcframe.errors import SimConfigError
from pcframe.sim.app_config import (
    SHORT,
    legend,
    register_schemas,
    results_rows,
    run_config,
    terminal_columns,
    write_outputs,
)
from pcframe.sim.report import fmt

register_schemas()
register_resolvers()
register_policy_configs()  # entry-point policies are options of policy/* and sim/predictor


def run(
    cfg: DictConfig, out_dir: str | Path, cwd: str | Path, console: Console | None = None
) -> list[Path]:
    """Simulate what ``cfg`` asks for and write the outputs to ``out_dir``."""
    check_targets(cfg.policy, "policy")
    if cfg.sim.predictor is not None:
        check_targets(cfg.sim.predictor, "sim.predictor")
    check_outputs(out_dir, cfg.output)  # before the simulations, not after them
    rows = results_rows(run_config(cfg, cwd))
    overrides = " ".join(HydraConfig.get().overrides.task) if HydraConfig.initialized() else ""
    command = f"pcframe-sim {overrides}".strip()
    written = write_outputs(rows, out_dir, cfg.output, header=command)
    console = console or Console()
    print_table(rows, console)
    return written


def check_outputs(out_dir: str | Path, output: Any) -> None:
    """Every output's folder exists or can be made (a path under /proc, or a file where a
    folder should be, was a raw ``FileNotFoundError`` once the simulations had run)."""
    for key in ("csv", "markdown"):
        given = getattr(output, key)
        target = Path(out_dir) / str(given)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SimConfigError(
                f"output.{key}={given!r}: cannot make {target.parent} ({exc.strerror}); "
                "give a path in a writable folder"
            ) from None
        odd = os.path.lexists(target) and (target.is_symlink() or not target.is_file())
        if odd or not os.access(target.parent, os.W_OK):  # a FIFO blocked after the runs
            what = "exists and is not a regular file" if odd else f"{target.parent} is not writable"
            raise SimConfigError(
                f"output.{key}={given!r}: {what}; give a file path in a writable folder"
            )


def print_table(rows: list[dict], console: Console) -> None:
    """The rows with the columns that fit the console (trace names whole), and a legend."""
    columns = terminal_columns(rows, console.width)
    table = Table(title="pcframe-sim", title_justify="left")
    for column in columns:
        table.add_column(
            SHORT.get(column, column),
            justify="left" if column in ("trace", "label") else "right",
            overflow="fold",  # a narrow terminal wraps a trace name, never cuts it
            no_wrap=column not in ("trace", "label"),
        )
    for row in rows:
        # Text, not a str: rich read a label or trace name as markup ('Daly[mtbf=3600]'
        # was shown as 'Daly', 'x[/y]' ended the run in a MarkupError)
        table.add_row(*(Text(fmt(row.get(c))) for c in columns))
    console.print(table)
    for line in legend(columns):
        header, _, meaning = line.partition(": ")
        console.print(f"[dim]{SHORT.get(header, header)}: {meaning}[/dim]", highlight=False)
    console.print("[dim]every column, per row: results.csv (described in results.meta.json)[/dim]")


@hydra.main(version_base="1.3", config_path="pkg://pcframe.conf", config_name="sim")
def _app(cfg: DictConfig) -> None:
    with reported("pcframe-sim"):
        out_dir = HydraConfig.get().runtime.output_dir
        for path in run(cfg, out_dir, get_original_cwd()):
            print(f"wrote {path}")


def main() -> None:
    run_app(_app, "pcframe-sim")


if __name__ == "__main__":
    main()
