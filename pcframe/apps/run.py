"""``pcframe-run``: train a built-in workload with checkpointing and print what it cost.

``failure=none`` trains in this process, with and without checkpointing, and reports the
overhead (a ± only where enough baseline runs give one). ``failure=poisson|trace`` runs
training as a child process under a :class:`~pcframe.apps.preemption.Supervisor` that
SIGKILLs it at the injected preemption times and restarts it; the kill schedule (and a
default checkpoint interval) is fitted to this machine from an uninterrupted reference run
(:mod:`pcframe.apps.preemption.plan`), and the summary reports goodput, lost steps and
restart time, and whether the final model equals the uninterrupted run's.

Every mode shows a progress bar, writes ``summary.json`` / ``summary.csv`` into the run's
output folder and ends with the checkpoint folder and the command that lists it; a
``--multirun`` sweep also gets one merged table (:class:`~pcframe.apps.summary.AggregateRuns`).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import statistics
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from pcframe.apps.bounds import check_bounds
from pcframe.apps.compose import engine_config, quiet_missing_user_conf
from pcframe.apps.errors import reported, run_app
from pcframe.apps.instantiate import build as build_target
from pcframe.apps.instantiate import check_targets, locate
from pcframe.apps.machine import describe_threads, resolve_threads
from pcframe.apps.policy_text import describe_policy, no_commit_reason, policy_from_config
from pcframe.apps.preemption import ChildSpec, Supervisor, compare_finals
from pcframe.apps.preemption.plan import Measured, check_plan, plan
from pcframe.apps.preemption.schedule import kill_times
from pcframe.apps.preflight import check_run_directory
from pcframe.apps.progress import StepProgress
from pcframe.apps.schemas import register_app_schemas
from pcframe.apps.summary import (
    Summary,
    baseline_spread,
    overhead_text,
    print_summary,
    write_summary,
)
from pcframe.apps.sweep import claim_directory
from pcframe.apps.training import train
from pcframe.apps.tuning.report import tuned_config_warnings
from pcframe.apps.workloads import build
from pcframe.errors import ConfigError
from pcframe.policies.fixed import FixedSteps

register_app_schemas()

WARMUP_STEPS = 30


def run(cfg: DictConfig, out_dir: str | Path | None = None) -> Summary:
    """Run what ``cfg`` describes; ``out_dir`` holds logs and final-state files."""
    out = Path(out_dir) if out_dir is not None else Path(cfg.directory).parent
    if cfg.failure.kind == "none":
        return run_in_process(cfg)
    return run_supervised(cfg, out)


def _common(cfg: DictConfig, threads: int) -> Summary:
    return {
        "workload": cfg.workload.name,
        "steps": cfg.steps,
        "threads": describe_threads(cfg.threads, threads),
    }


def run_in_process(cfg: DictConfig) -> Summary:
    threads = resolve_threads(cfg.threads)
    torch.set_num_threads(threads)
    engine = engine_config(cfg)
    engine.check_runtime()  # kernels=triton without a GPU: refused before the warm-up
    workload_args = OmegaConf.to_container(cfg.workload.args, resolve=True)
    summary = _common(cfg, threads)
    # Built before the warm-up: an argument the policy refuses is reported before any step.
    policy = build_target(cfg.policy.interval, "policy.interval")

    def fresh() -> Any:
        return build(cfg.workload.name, **workload_args)

    # A folder it cannot use, or one already past the steps: refused before any step.
    check_run_directory(cfg.directory, fresh(), cfg.steps)

    with StepProgress(enabled=cfg.progress) as bar:
        # Warm up allocator, kernels and caches so the first timed run is not penalised.
        warm = min(cfg.steps, WARMUP_STEPS)
        bar.start("warm-up", warm)
        train(fresh(), warm, progress=bar.step)
        bar.finish()

        def baseline(label: str) -> float:
            bar.start(label, cfg.steps)
            rate = train(fresh(), cfg.steps, progress=bar.step)[0].steps_per_second
            bar.finish()
            return rate

        # The baseline runs go before and after the checkpointed run (the first half
        # before): their mean cancels a drift of the machine's speed. Two runs are too few
        # for an uncertainty (summary.overhead_text prints a ± from 3 on).
        runs = cfg.baseline_runs if cfg.baseline else 0
        first = (runs + 1) // 2
        rates = [baseline(f"without checkpoints ({i} of {runs})") for i in range(1, first + 1)]
        bar.start("with checkpoints", cfg.steps)
        result, checkpointer = train(
            fresh(),
            cfg.steps,
            cfg.directory,
            policy,
            engine,
            progress=bar.step,
            on_restored=lambda step, seconds: bar.resume(step or 0),
            on_commit=lambda count, step: bar.set_commits(count),
            stop_on_notice=True,
        )
        bar.finish(f"{bar.commits} checkpoints committed")
        rates += [
            baseline(f"without checkpoints ({i} of {runs})") for i in range(first + 1, runs + 1)
        ]

    records = list(checkpointer.records.values())
    committed = [r for r in records if r.status == "committed"]
    failed = [r for r in records if r.status == "failed"]
    stalls = [r.stall for r in committed] or [0.0]
    summary.update(
        policy=describe_policy(policy),
        steps_per_s=result.steps_per_second,
        start_step=result.start_step,
        final_loss=result.losses[-1] if result.losses else float("nan"),
        checkpoints=len(committed),
        bytes_written=sum(r.nbytes for r in committed),
        stall_mean_ms=1e3 * statistics.fmean(stalls),
        stall_max_ms=1e3 * max(stalls),
        durable_mean_ms=1e3 * statistics.fmean([r.durable for r in committed] or [0.0]),
        directory=str(Path(cfg.directory).resolve()),
    )
    if failed:
        summary["saves_failed"] = len(failed)
    if rates:
        mean = statistics.fmean(rates)
        spread, noise = baseline_spread(rates)
        summary["baseline_steps_per_s"] = mean
        summary["baseline_runs"] = len(rates)
        summary["baseline_spread_pct"] = spread
        if committed:
            overhead = 100 * (1 - result.steps_per_second / mean) if mean else 0.0
            summary["overhead_pct"] = overhead
            # None below 3 baseline runs: there is no uncertainty to report (summary.py).
            summary["overhead_noise_pct"] = noise
            summary["overhead_within_noise"] = None if noise is None else abs(overhead) <= noise
            summary["overhead"] = overhead_text(overhead, rates)
        else:
            summary["overhead"] = "n/a: no checkpoint committed"
    warnings = []
    if result.start_step:
        warnings.append(
            f"{cfg.directory} already held a checkpoint at step {result.start_step}: the "
            f"checkpointed run resumed there and trained {cfg.steps - result.start_step} of "
            f"{cfg.steps} steps, so its numbers are not comparable with the baselines; give "
            "a new directory=... (or none: each run's own output folder) to measure afresh"
        )
    if result.noticed:
        summary["stopped_on_notice"] = result.stopped_at
        warnings.append(
            f"stopped at step {result.stopped_at} of {cfg.steps} on a preemption notice "
            f"({checkpointer.notice.source if checkpointer.notice else 'notice'}); rerun with "
            f"directory={cfg.directory} to resume from the newest version"
        )
    if not committed:
        warnings.append(no_commit_reason(policy, cfg, result.seconds, result.start_step, failed))
    summary["warnings"] = warnings
    return summary


def child_spec(
    cfg: DictConfig, directory: str | Path, final: Path | None, threads: int | None = None
) -> ChildSpec:
    return ChildSpec(
        directory=str(directory),
        steps=cfg.steps,
        workload=cfg.workload.name,
        workload_args=OmegaConf.to_container(cfg.workload.args, resolve=True),
        engine=engine_config(cfg).to_dict(),
        policy=OmegaConf.to_container(cfg.policy.interval, resolve=True),
        threads=threads if threads is not None else resolve_threads(cfg.threads),
        final=str(final) if final is not None else None,
    )


def fixed_steps_interval(cfg: DictConfig) -> tuple[int | None, bool]:
    """``(every, pinned)`` of a ``FixedSteps`` interval policy (``(None, True)`` otherwise).

    ``pinned``: set on purpose (on the command line or by an experiment: anything but the
    shipped default), so a supervised run keeps it instead of deriving one.
    """
    node = cfg.policy.interval
    try:
        if locate(str(node.get("_target_"))) is not FixedSteps:
            return None, True
    except Exception:
        return None, True
    every = int(node.every)
    if HydraConfig.initialized():
        keys = {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}
        if "policy.interval.every" in keys:
            return every, True
    default = importlib.resources.files("pcframe.conf") / "policy/interval/fixed_steps.yaml"
    return every, every != OmegaConf.load(str(default)).get("every")


def run_supervised(cfg: DictConfig, out: Path, progress: bool = True) -> Summary:
    """Train under the supervisor with the ``failure`` group's kills (and a reference run)."""
    failure = cfg.failure
    # The children build the policy; building it here first refuses a bad argument before
    # the reference run instead of in every child.
    build_target(cfg.policy.interval, "policy.interval")
    kill_times(failure)  # and a bad failure.* (a missing trace file) before it, too
    engine_config(cfg).check_runtime()  # and kernels the machine cannot run
    workload_args = OmegaConf.to_container(cfg.workload.args, resolve=True)
    check_run_directory(cfg.directory, build(cfg.workload.name, **workload_args), cfg.steps)
    threads = resolve_threads(cfg.threads)
    out.mkdir(parents=True, exist_ok=True)
    final = out / "final.safetensors"
    spec = child_spec(cfg, cfg.directory, final if failure.reference else None, threads)
    every, pinned = fixed_steps_interval(cfg)
    summary = _common(cfg, threads)
    summary["policy"] = policy_from_config(cfg.policy.interval)
    measured = None
    reference_lives: list[Any] = []
    with StepProgress(enabled=cfg.progress and progress, kills=True) as bar:
        if failure.reference:
            reference = dataclasses.replace(
                spec,
                directory=str(out / "reference-checkpoints"),
                final=str(out / "reference.safetensors"),
            )
            bar.start("reference run, no kills", cfg.steps)
            ref = Supervisor(
                reference,
                timeout=failure.timeout,
                log_dir=out / "logs" / "reference",
                on_line=_feed(bar),
            ).run()
            bar.finish(f"{ref.commits} checkpoints committed")
            summary["reference_wall_s"] = ref.wall
            measured = Measured.from_life(ref.lives[0], cfg.steps)
            reference_lives = ref.lives
        schedule = plan(failure, measured, every=every, every_pinned=pinned)
        if schedule.every is not None:
            spec.policy = {**(spec.policy or {}), "every": schedule.every}
            summary["policy"] = f"FixedSteps: every {schedule.every} steps ({schedule.interval})"
        if measured is not None:
            check_plan(schedule, failure, measured, summary["policy"].split(" (")[0], every)
        summary["schedule"] = schedule.schedule
        bar.start("run with kills", cfg.steps)
        result = Supervisor(
            spec,
            schedule.times,
            restart_delay=failure.restart_delay,
            clock=schedule.clock,
            timeout=failure.timeout,
            log_dir=out / "logs" / "supervised",
            on_line=_feed(bar),
        ).run()
        bar.finish(f"{result.kills} kills, {result.commits} checkpoints committed")
    restarts = result.restart_seconds
    restores = [life.restore_seconds for life in result.lives[1:] if life.start_step is not None]
    # Stall and time to durable per checkpoint, as the children measured them: the
    # uninterrupted reference run's if there was one, else the process that finished.
    costs = [life.done for life in reference_lives + result.lives[-1:]]
    done = next((d for d in costs if d and d.get("checkpoints")), None)
    if done is not None:
        summary["stall_mean_ms"] = 1e3 * done["stall"] / done["checkpoints"]
        summary["durable_mean_ms"] = 1e3 * done.get("durable", 0.0) / done["checkpoints"]
    summary.update(
        start_step=result.lives[0].start_step or 0,  # > 0: the directory held a checkpoint
        kills=result.kills,
        processes=len(result.lives),
        checkpoints=result.commits,
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
    warnings = []
    if summary["start_step"]:
        warnings.append(
            f"{cfg.directory} already held a checkpoint at step {summary['start_step']}: the "
            "supervised run resumed there instead of training from the start; give a new "
            "directory=... (or none: each run's own output folder) for a whole run"
        )
    if result.kills == 0:
        unit = schedule.clock.unit
        first = f" (the first at {schedule.times[0]:.1f}{unit})" if schedule.times else ""
        warnings.append(
            f"no kill landed: the run was over after {result.wall:.1f} s, before any of the "
            f"{len(schedule.times)} scheduled kills{first}; leave failure.mtbf / "
            "failure.compression null to fit the schedule to this machine, or raise steps"
        )
    if result.commits == 0:
        warnings.append(
            "no checkpoint was committed: the interval is longer than what a process lived "
            f"({summary['policy']}); lower policy.interval.every or raise steps"
        )
    summary["warnings"] = warnings
    return summary


def _feed(bar: StepProgress) -> Any:
    """A supervisor ``on_line`` callback that drives the progress bar."""
    commits = 0

    def line(index: int, text: str) -> None:
        nonlocal commits
        if index != bar.kills:
            bar.set_kills(index)
        if text.startswith("step "):
            bar.step(int(text.split()[1]))
        elif text.startswith("pcframe-event ") and '"committed"' in text:
            commits += 1
            bar.set_commits(commits)

    return line


@hydra.main(version_base="1.3", config_path="pkg://pcframe.conf", config_name="run")
def _app(cfg: DictConfig) -> None:
    with reported("pcframe-run"):
        _task(cfg)


def _task(cfg: DictConfig) -> None:
    unused = [g for g in ("placement", "resource") if g in (cfg.get("policy") or {})]
    if unused:  # composed with +policy/placement=...: it would be silently ignored
        raise ConfigError(
            f"policy/{unused[0]} is used by pcframe-sim only: pcframe-run trains one process "
            "saving to storage.directory (no tiers to place in, no VMs to choose); remove it"
        )
    check_targets(cfg)
    check_bounds(cfg, "run")
    hydra_cfg = HydraConfig.get()
    console = Console()
    tuned = tuned_config_warnings(cfg, hydra_cfg)
    for warning in tuned:  # now, before the run, and again with the summary
        console.print(f"[bold yellow]warning:[/bold yellow] {warning}", soft_wrap=True)
    out = hydra_cfg.runtime.output_dir
    if hydra_cfg.mode == RunMode.MULTIRUN:
        claim_directory(cfg.directory, hydra_cfg.sweep.dir, hydra_cfg.job.num)
    summary = run(cfg, out)
    summary.setdefault("warnings", []).extend(tuned)
    job = OmegaConf.select(hydra_cfg, "job.num", default=None, throw_on_missing=False)
    title = "pcframe-run summary" + (f" (job {job})" if job is not None else "")
    print_summary(summary, title, console)
    write_summary(summary, out, list(hydra_cfg.overrides.task), job)
    print(f"summary: {Path(out).resolve() / 'summary.json'}")


def main() -> None:
    quiet_missing_user_conf()
    run_app(_app, "pcframe-run")


if __name__ == "__main__":
    main()
