"""``pcframe-run``: train a built-in workload with checkpointing and print what it cost.

``failure=none`` trains in this process, with and without checkpointing, and reports the
overhead. ``failure=poisson|trace`` runs training as a child process under a
:class:`~pcframe.apps.preemption.Supervisor` that SIGKILLs it at the injected preemption times and
restarts it; the summary then reports goodput, lost steps and restart time, and whether the
final model equals an uninterrupted run's.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from pcframe.apps.compose import engine_config, quiet_missing_user_conf
from pcframe.apps.preemption import ChildSpec, Supervisor, compare_finals, kill_times
from pcframe.apps.schemas import register
from pcframe.apps.targets import check_targets
from pcframe.apps.training import train
from pcframe.apps.workloads import build

register()

Summary = dict[str, float | int | str]


def run(cfg: DictConfig, out_dir: str | Path | None = None) -> Summary:
    """Run what ``cfg`` describes; ``out_dir`` holds logs and final-state files."""
    out = Path(out_dir) if out_dir is not None else Path(cfg.directory).parent
    if cfg.failure.kind == "none":
        return run_in_process(cfg)
    return run_supervised(cfg, out)


def run_in_process(cfg: DictConfig) -> Summary:
    torch.set_num_threads(cfg.threads)
    engine = engine_config(cfg)
    workload_args = OmegaConf.to_container(cfg.workload.args, resolve=True)
    summary: Summary = {}
    # Warm up allocator, kernels and caches so the first timed run is not penalised.
    train(build(cfg.workload.name, **workload_args), min(cfg.steps, 30))

    def baseline() -> float:
        return train(build(cfg.workload.name, **workload_args), cfg.steps)[0].steps_per_second

    # The baseline runs before and after the checkpointed run: their mean cancels drift of
    # the machine's speed, and their difference shows how much a run varies by itself.
    before = baseline() if cfg.baseline else None
    policy = instantiate(cfg.policy.interval)
    result, checkpointer = train(
        build(cfg.workload.name, **workload_args), cfg.steps, cfg.directory, policy, engine
    )
    if before is not None:
        after = baseline()
        summary["baseline_steps_per_s"] = (before + after) / 2
        summary["baseline_spread_pct"] = 100 * abs(before - after) / ((before + after) / 2)
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


def child_spec(cfg: DictConfig, directory: str | Path, final: Path | None) -> ChildSpec:
    return ChildSpec(
        directory=str(directory),
        steps=cfg.steps,
        workload=cfg.workload.name,
        workload_args=OmegaConf.to_container(cfg.workload.args, resolve=True),
        engine=engine_config(cfg).to_dict(),
        policy=OmegaConf.to_container(cfg.policy.interval, resolve=True),
        threads=cfg.threads,
        final=str(final) if final is not None else None,
    )


def run_supervised(cfg: DictConfig, out: Path, progress: bool = True) -> Summary:
    """Train under the supervisor with the ``failure`` group's kills (and a reference run)."""
    failure = cfg.failure
    times = kill_times(failure)
    out.mkdir(parents=True, exist_ok=True)
    final = out / "final.safetensors"
    spec = child_spec(cfg, cfg.directory, final if failure.reference else None)
    summary: Summary = {}
    with _StepProgress(cfg.steps, enabled=progress) as bar:
        if failure.reference:
            reference = dataclasses.replace(
                spec,
                directory=str(out / "reference-checkpoints"),
                final=str(out / "reference.safetensors"),
            )
            bar.start("uninterrupted reference run")
            ref = Supervisor(
                reference,
                timeout=failure.timeout,
                log_dir=out / "logs" / "reference",
                on_line=bar.line,
            ).run()
            summary["reference_wall_s"] = ref.wall
        bar.start(f"run with {len(times)} scheduled kills")
        result = Supervisor(
            spec,
            times,
            restart_delay=failure.restart_delay,
            timeout=failure.timeout,
            log_dir=out / "logs" / "supervised",
            on_line=bar.line,
        ).run()
    restarts = result.restart_seconds
    restores = [life.restore_seconds for life in result.lives[1:] if life.start_step is not None]
    summary.update(
        start_step=result.lives[0].start_step or 0,  # > 0: the directory held a checkpoint
        steps=result.steps,
        kills=result.kills,
        processes=len(result.lives),
        executed_steps=result.executed_steps,
        lost_steps=result.lost_steps,
        wall_s=result.wall,
        goodput_steps_per_s=result.goodput,
        restart_mean_s=statistics.fmean(restarts) if restarts else 0.0,
        restore_mean_s=statistics.fmean(restores) if restores else 0.0,
        directory=str(Path(cfg.directory).resolve()),
    )
    if failure.reference:
        summary["efficiency"] = summary["reference_wall_s"] / result.wall
        differing = compare_finals(out / "reference.safetensors", final)
        summary["matches_reference"] = (
            "yes, bit-identical" if not differing else f"NO: {len(differing)} tensors differ"
        )
    return summary


class _StepProgress:
    """A rich progress bar fed by the supervisor's stdout lines (quiet when not a terminal)."""

    def __init__(self, steps: int, enabled: bool) -> None:
        self.steps = steps
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("kills {task.fields[kills]}"),
            transient=True,
            disable=not enabled,
        )
        self.task: Any = None
        self._last_index = 0

    def __enter__(self) -> _StepProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def start(self, description: str) -> None:
        if self.task is not None:
            self.progress.remove_task(self.task)
        self.task = self.progress.add_task(description, total=self.steps, kills=0)
        self._last_index = 0

    def line(self, index: int, line: str) -> None:
        if index != self._last_index:
            self._last_index = index
            self.progress.update(self.task, kills=index)
        if line.startswith("step "):
            self.progress.update(self.task, completed=int(line.split()[1]))


LABELS = {
    "baseline_steps_per_s": "steps/s without checkpointing",
    "steps_per_s": "steps/s with checkpointing",
    "overhead_pct": "throughput overhead (%)",
    "baseline_spread_pct": "run-to-run spread of the baseline (%)",
    "start_step": "resumed from step",
    "final_loss": "final loss",
    "checkpoints": "checkpoints committed",
    "bytes_written": "bytes written",
    "stall_mean_ms": "stall per checkpoint, mean (ms)",
    "stall_max_ms": "stall per checkpoint, max (ms)",
    "durable_mean_ms": "save() to durable, mean (ms)",
    "steps": "training steps",
    "kills": "preemptions injected (SIGKILL)",
    "processes": "training processes started",
    "executed_steps": "steps executed (incl. lost)",
    "lost_steps": "steps lost to preemptions",
    "wall_s": "wall time (s)",
    "goodput_steps_per_s": "goodput (useful steps/s)",
    "restart_mean_s": "restart time, kill to next step, mean (s)",
    "restore_mean_s": "restore from checkpoint, mean (s)",
    "reference_wall_s": "wall time without preemptions (s)",
    "efficiency": "efficiency (reference / actual wall time)",
    "matches_reference": "final model equals uninterrupted run",
    "directory": "checkpoints in",
}


def print_summary(summary: Summary, title: str = "pcframe-run summary") -> None:
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, label in LABELS.items():
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
def _app(cfg: DictConfig) -> None:
    check_targets(cfg)
    print_summary(run(cfg, HydraConfig.get().runtime.output_dir))


def main() -> None:
    quiet_missing_user_conf()
    _app()


if __name__ == "__main__":
    main()
