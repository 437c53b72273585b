"""``pcframe-run``: train a built-in workload with checkpointing and print what it cost."""

from __future__ import annotations

import statistics
from pathlib import Path

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from pcframe.apps.schemas import register
from pcframe.config import EngineConfig
from pcframe.training import train
from pcframe.workloads import build

register()


def run(cfg: DictConfig) -> dict[str, float | int | str]:
    torch.set_num_threads(cfg.threads)
    engine = EngineConfig(**OmegaConf.to_container(cfg.engine, resolve=True))
    workload_args = OmegaConf.to_container(cfg.workload.args, resolve=True)
    summary: dict[str, float | int | str] = {}
    # Warm up allocator, kernels and caches so the first timed run is not penalised.
    train(build(cfg.workload.name, **workload_args), min(cfg.steps, 30))
    if cfg.baseline:
        result, _ = train(build(cfg.workload.name, **workload_args), cfg.steps)
        summary["baseline_steps_per_s"] = result.steps_per_second
    policy = instantiate(cfg.policy.interval)
    result, checkpointer = train(
        build(cfg.workload.name, **workload_args), cfg.steps, cfg.directory, policy, engine
    )
    records = [r for r in checkpointer.records.values() if r.status == "committed"]
    stalls = [r.stall for r in records] or [0.0]
    summary.update(
        steps_per_s=result.steps_per_second,
        start_step=result.start_step,
        final_loss=result.losses[-1] if result.losses else float("nan"),
        checkpoints=len(records),
        bytes_written=sum(r.nbytes for r in records),
        stall_mean_ms=1e3 * statistics.fmean(stalls),
        stall_max_ms=1e3 * max(stalls),
        durable_mean_ms=1e3 * statistics.fmean([r.durable for r in records] or [0.0]),
        directory=str(Path(cfg.directory).resolve()),
    )
    if "baseline_steps_per_s" in summary:
        summary["overhead_pct"] = 100 * (
            1 - summary["steps_per_s"] / summary["baseline_steps_per_s"]
        )
    return summary


def print_summary(summary: dict[str, float | int | str]) -> None:
    table = Table(title="pcframe-run summary", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    labels = {
        "baseline_steps_per_s": "steps/s without checkpointing",
        "steps_per_s": "steps/s with checkpointing",
        "overhead_pct": "throughput overhead (%)",
        "start_step": "resumed from step",
        "final_loss": "final loss",
        "checkpoints": "checkpoints committed",
        "bytes_written": "bytes written",
        "stall_mean_ms": "stall per checkpoint, mean (ms)",
        "stall_max_ms": "stall per checkpoint, max (ms)",
        "durable_mean_ms": "save() to durable, mean (ms)",
        "directory": "checkpoints in",
    }
    for key, label in labels.items():
        if key in summary:
            value = summary[key]
            text = (
                f"{value:,.3f}"
                if isinstance(value, float)
                else f"{value:,}"
                if isinstance(value, int)
                else str(value)
            )
            table.add_row(label, text)
    Console().print(table)


@hydra.main(version_base="1.3", config_path="pkg://pcframe.conf", config_name="run")
def main(cfg: DictConfig) -> None:
    print_summary(run(cfg))


if __name__ == "__main__":
    main()
