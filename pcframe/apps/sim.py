"""``pcframe-sim``: simulate a checkpointed training job over spot traces (a Hydra app).

One run simulates the configured interval (and resource) policy, plus the baselines, on
every selected trace and writes ``results.csv``, ``results.md`` and plots into Hydra's output
folder; ``--multirun`` sweeps also get merged results in the sweep folder. See
``conf/sim.yaml`` and docs/simulator.md.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from pcframe.apps.targets import check_targets
from pcframe.sim.app_config import (
    TABLE_COLUMNS,
    register_schemas,
    results_rows,
    run_config,
    write_outputs,
)
from pcframe.sim.report import fmt

register_schemas()


def run(cfg: DictConfig, out_dir: str | Path, cwd: str | Path) -> list[Path]:
    """Simulate what ``cfg`` asks for and write the outputs to ``out_dir``."""
    check_targets(cfg.policy, "policy")
    if cfg.sim.predictor is not None:
        check_targets(cfg.sim.predictor, "sim.predictor")
    rows = results_rows(run_config(cfg, cwd))
    overrides = " ".join(HydraConfig.get().overrides.task) if HydraConfig.initialized() else ""
    header = f"pcframe-sim {overrides}".strip()
    written = write_outputs(rows, out_dir, cfg.output, header=header)
    table = Table(title="pcframe-sim")
    columns = (*TABLE_COLUMNS[:4], "preemptions", "saves", "cost")
    for column in columns:
        table.add_column(column, justify="left" if column in ("trace", "label") else "right")
    for row in rows:
        table.add_row(*(fmt(row.get(c)) for c in columns))
    Console().print(table)
    return written


@hydra.main(version_base="1.3", config_path="pkg://pcframe.conf", config_name="sim")
def main(cfg: DictConfig) -> None:
    out_dir = HydraConfig.get().runtime.output_dir
    for path in run(cfg, out_dir, get_original_cwd()):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
