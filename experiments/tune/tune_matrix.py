"""Tuned for one target, best on that target: the cross-matrix of tuned configs x targets.

1. Tunes the engine on every target (``conf/tune/target/``: disk, throttled, tmpfs, s3),
   each inside its own real setup (blkio cgroup, loopback S3 server), with the same budget
   (``tune=matrix``: ``--trials`` trials, objective ``lost`` per checkpoint).
2. Measures every tuned config and the default on every target, ``--repeats`` times in a
   rotating order (fresh model and directory each time), plus each target's limits
   (memcpy; disk write rate, or the loopback server's PUT rate for s3).
3. Optionally (``--workers``) runs one study with 1 worker and then the same budget with 2
   ``pcframe-tune`` processes on one journal file, and times both.
4. Writes ``experiments/results/tune_matrix.md``, ``tune_matrix.png`` (heat map) and
   ``tune_matrix_importance.png`` (Optuna's own parameter-importance plots).

    python experiments/tune/tune_matrix.py --trials 10 --repeats 4 --workers 12
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch
from matrix_report import write_report
from omegaconf import OmegaConf
from rich.console import Console

from pcframe.apps.compose import compose_config, engine_config
from pcframe.apps.tuning import Tuner, best_trial, measure
from pcframe.apps.tuning.target_storage import Limit, TargetSpec, open_target
from pcframe.apps.tuning.throttle import ProbeResult, probe_throttle
from pcframe.apps.workloads import build
from pcframe.config import EngineConfig
from pcframe.errors import ConfigError

RESULTS = Path(__file__).resolve().parents[1] / "results"
TARGETS = ("disk", "throttled", "tmpfs", "s3")
WORKLOAD = ["workload=gpt", "workload.args.width=192", "workload.args.layers=2", "threads=1"]


@dataclass
class TargetRun:
    """Everything measured on one target."""

    name: str
    refused: str | None = None
    study: optuna.Study | None = None
    tuned: EngineConfig | None = None
    tuning_s: float = 0.0
    limit: Limit | None = None
    probe: dict[str, ProbeResult] = field(default_factory=dict)
    cells: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # config -> repeats


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=10, help="Optuna trials per target")
    p.add_argument("--repeats", type=int, default=4, help="measurements per matrix cell")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--workers", type=int, default=0, help="trials of the 1-vs-2 worker study")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args()


def base_overrides(target: str, args: argparse.Namespace, scratch: Path) -> list[str]:
    return [
        *WORKLOAD,
        "tune=matrix",
        f"tune/target={target}",
        f"tune.n_trials={args.trials}",
        "tune.storage=null",
        f"tune.study_name=matrix-{target}",
        f"tune.report_dir={scratch}",
        "tune.progress=false",
    ]


def tune_on(run: TargetRun, args: argparse.Namespace, scratch: Path, console: Console) -> None:
    base = base_overrides(run.name, args, scratch)
    cfg = compose_config("tune", base)
    spec = TargetSpec.from_config(cfg.tune.target)
    with open_target(spec, cfg.storage.directory) as active:
        tuner = Tuner(
            cfg,
            compose=lambda extra: compose_config("tune", [*base, *extra]),
            console=console,
            tiers=active.tiers,
        )
        started = time.perf_counter()
        run.study = tuner.run()
        run.tuning_s = time.perf_counter() - started
        _, run.tuned = tuner.trial_config(dict(best_trial(run.study, tuner.objectives).params))


def measure_on(
    run: TargetRun, engines: dict[str, EngineConfig], args: argparse.Namespace, scratch: Path
) -> None:
    """Every engine on this target, ``repeats`` rounds in rotating order; then its limits."""
    cfg = compose_config("tune", base_overrides(run.name, args, scratch))
    spec = TargetSpec.from_config(cfg.tune.target)
    tune = cfg.tune
    names = list(engines)
    workload_args = OmegaConf.to_container(cfg.workload.args)
    with open_target(spec, cfg.storage.directory) as active:
        if spec is not None and spec.kind == "throttled":
            run.probe["inside the throttle"] = probe_throttle(active.directory)
        nbytes = 0
        for r in range(args.repeats):
            # Rotate who goes first: drift on a shared machine hits every config alike.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                directory = active.directory / f"cell-{name}-{r}"
                label = f"cell-{name.replace('@', '-')}-{r}"
                m = measure(
                    build(cfg.workload.name, **workload_args),
                    engines[name],
                    directory,
                    interval=tune.interval,
                    steps=tune.steps,
                    repeats=tune.repeats,
                    warmup_steps=tune.warmup_steps,
                    tiers=active.tiers(label),
                )
                shutil.rmtree(directory, ignore_errors=True)
                nbytes = m.checkpoint_bytes
                row = m.summary()
                row["interval_s"] = tune.interval * row["baseline_step_s"]
                run.cells.setdefault(name, []).append(row)
                print(
                    f"  {run.name:9s} {name:15s} round {r}: lost {row['lost_s'] * 1e3:7.1f} ms"
                    f"  stall {row['stall_s'] * 1e3:7.1f} ms  cpu {row['cpu_s'] * 1e3:6.1f} ms"
                    f"  drain {row['drain_s'] * 1e3:6.1f} ms",
                    flush=True,
                )
        run.limit = active.limits(nbytes, repeats=3)
    if spec is not None and spec.kind == "throttled":
        run.probe["outside (same disk)"] = probe_throttle(active.directory)


def worker_speedup(trials: int, scratch: Path) -> dict[str, Any]:
    """Wall time of one study of ``trials`` on the disk target: 1 worker, then 2 workers."""
    result: dict[str, Any] = {"trials": trials}
    for workers in (1, 2):
        journal = scratch / f"workers-{workers}.log"
        command = [
            sys.executable,
            "-m",
            "pcframe.apps.tune",
            *WORKLOAD,
            "tune=matrix",
            "tune/target=disk",
            f"tune.n_trials={trials}",
            "tune.confirm=0",  # the same budget for both: exactly `trials` trials
            "tune.seed=null",  # each worker its own sampler stream
            f"tune.storage=journal://{journal}",
            f"tune.study_name=workers-{workers}",
            "tune.write_config=null",
            "tune.progress=false",
            f"hydra.run.dir={scratch}/hydra-{workers}-${{now:%H%M%S%f}}",
        ]
        started = time.perf_counter()
        procs = [
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for _ in range(workers)
        ]
        errors = [p.communicate()[1] for p in procs]
        wall = time.perf_counter() - started
        for p, err in zip(procs, errors, strict=True):
            if p.returncode != 0:
                raise RuntimeError(f"worker failed ({p.returncode}): {err.decode()[-2000:]}")
        storage = optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(journal))
        )
        study = optuna.load_study(study_name=f"workers-{workers}", storage=storage)
        done = [t for t in study.trials if t.datetime_complete is not None]
        span = max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)
        result[workers] = {
            "wall_s": wall,
            "trials_span_s": span.total_seconds(),
            "finished": len(done),
            "best_lost_ms": min(t.value for t in done if t.value is not None) * 1e3,
            "per_worker": _per_worker(done),
        }
        print(f"  {workers} worker(s): {wall:.1f} s wall, {len(done)} trials", flush=True)
    return result


def _per_worker(trials: list[optuna.trial.FrozenTrial]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in trials:
        worker = str(t.user_attrs.get("worker", "?"))
        counts[worker] = counts.get(worker, 0) + 1
    return counts


def main() -> int:
    args = parse()
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="pcframe-tune-matrix-"))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)
    console = Console(quiet=True)
    runs = {name: TargetRun(name) for name in args.targets.split(",")}
    for run in runs.values():
        print(f"tuning on {run.name} ...", flush=True)
        try:
            tune_on(run, args, scratch, console)
        except ConfigError as exc:  # the machine cannot provide this target: say so, go on
            run.refused = str(exc)
            print(f"  refused: {exc}", flush=True)
            continue
        print(f"  {run.tuning_s:.0f} s, tuned: {run.tuned}", flush=True)
    default = engine_config(compose_config("tune", base_overrides("disk", args, scratch)))
    engines = {"default": default}
    engines.update({f"tuned@{r.name}": r.tuned for r in runs.values() if r.tuned is not None})
    for run in runs.values():
        if run.refused is None:
            print(f"measuring on {run.name} ...", flush=True)
            measure_on(run, engines, args, scratch)
    speedup = None
    if args.workers:
        print("1 vs 2 workers ...", flush=True)
        speedup = worker_speedup(args.workers, scratch)
    command = "python experiments/tune/tune_matrix.py " + " ".join(sys.argv[1:])
    write_report(
        out, command, runs, engines, speedup, time.perf_counter() - started, WORKLOAD, args
    )
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
