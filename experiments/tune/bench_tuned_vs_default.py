"""Tuned vs default engine on this machine, in one run: tune, then re-measure both fresh.

1. Runs a pcframe-tune study (Optuna over the engine knobs of ``conf/tune/default.yaml``)
   on the GPT workload, checkpointing every ``--interval`` steps.
2. Re-measures the default engine and the tuned one in alternating rounds (fresh model,
   fresh directory each time), so the comparison is not the study's own, selection-biased
   numbers, and drift on the machine hits both alike.
3. Writes ``experiments/results/tune_tuned_vs_default.md`` (comparison, ratios tuned /
   default), ``tune_study.md`` (all trials) and ``tune_study.png`` (objective per trial).

    python experiments/tune/bench_tuned_vs_default.py --trials 16 --rounds 4
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import optuna
import torch
from omegaconf import OmegaConf

from pcframe.apps.compose import compose_config, engine_config
from pcframe.apps.tuning import Tuner, best_trial, measure, plot, trials_table
from pcframe.apps.workloads import build
from pcframe.config import EngineConfig

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

RESULTS = Path(__file__).resolve().parents[1] / "results"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=16, help="Optuna trials of the study")
    p.add_argument("--rounds", type=int, default=4, help="alternating comparison rounds")
    p.add_argument("--interval", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--steps", type=int, default=20, help="steps per measured segment")
    p.add_argument("--repeats", type=int, default=8, help="A/B pairs per measurement")
    p.add_argument("--workload", default="gpt")
    p.add_argument("--objective", default="overhead", help="overhead | stall | cpu | cost")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default=None, help="scratch folder on the disk to measure")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args()


def main() -> int:
    args = parse()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="pcframe-tune-bench-", dir=args.dir))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    base = [
        f"workload={args.workload}",
        "tune=default",
        f"threads={args.threads}",
        f"tune.n_trials={args.trials}",
        f"tune.interval={args.interval}",
        f"tune.steps={args.steps}",
        f"tune.repeats={args.repeats}",
        f"tune.objectives=[{args.objective}]",
        "tune.storage=null",
        "tune.study_name=bench",
        f"tune.report_dir={scratch}",
        f"storage.directory={scratch / 'ckpt'}",
    ]
    cfg = compose_config("tune", base)
    tuner = Tuner(cfg, compose=lambda extra: compose_config("tune", [*base, *extra]))
    started = time.perf_counter()
    study = tuner.run()
    tuning_s = time.perf_counter() - started
    best = best_trial(study, tuner.objectives)
    _, tuned = tuner.trial_config(dict(best.params))
    default = engine_config(cfg)

    rows = compare(cfg, {"default": default, "tuned": tuned}, args, scratch)
    write_report(out, args, study, tuner, best, default, tuned, rows, tuning_s)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def compare(cfg, engines: dict[str, EngineConfig], args, scratch: Path) -> dict[str, list]:
    """``rounds`` alternating measurements of each engine (order flipped every round)."""
    torch.set_num_threads(args.threads)
    workload_args = OmegaConf.to_container(cfg.workload.args)
    results: dict[str, list] = {name: [] for name in engines}
    names = list(engines)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            directory = scratch / f"cmp-{name}-{r}"
            m = measure(
                build(cfg.workload.name, **workload_args),
                engines[name],
                directory,
                interval=args.interval,
                steps=args.steps,
                repeats=args.repeats,
                warmup_steps=5,
            )
            shutil.rmtree(directory, ignore_errors=True)
            results[name].append(m)
            print(f"round {r} {name:8s} {fmt_row(m.summary())}", flush=True)
    return results


def fmt_row(s: dict[str, float]) -> str:
    return (
        f"overhead {100 * s['overhead']:6.1f} %  stall {1e3 * s['stall_s']:7.1f} ms  "
        f"cpu {1e3 * s['cpu_s']:7.1f} ms  durable {1e3 * s['durable_s']:7.1f} ms  "
        f"memory {s['memory_bytes'] / 2**20:6.1f} MiB"
    )


def write_report(out, args, study, tuner, best, default, tuned, rows, tuning_s) -> None:
    command = "python experiments/tune/bench_tuned_vs_default.py " + " ".join(sys.argv[1:])
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"torch threads {args.threads}; load average at the end {os.getloadavg()[0]:.1f}"
    )

    def med(name: str, key: str) -> float:
        return statistics.median(m.summary()[key] for m in rows[name])

    def spread(name: str, key: str, scale: float) -> str:
        values = [m.summary()[key] * scale for m in rows[name]]
        return f"{statistics.median(values):.1f} ({min(values):.1f} – {max(values):.1f})"

    metrics = [
        ("throughput overhead at the interval (%)", "overhead", 100.0),
        ("stall per checkpoint (ms)", "stall_s", 1e3),
        ("engine CPU time per checkpoint, all its threads (ms)", "cpu_s", 1e3),
        ("cost = stall + CPU per checkpoint (ms)", "cost_s", 1e3),
        ("save() to durable (ms)", "durable_s", 1e3),
        ("host staging memory (MiB)", "memory_bytes", 2**-20),
        ("step time without checkpoints (ms)", "baseline_step_s", 1e3),
    ]
    lines = [
        *header("Tuned vs default engine configuration", command),
        f"Machine: {machine}. Workload `{args.workload}` (checkpoint "
        f"{rows['default'][0].checkpoint_bytes / 1e6:.1f} MB), a checkpoint every "
        f"{args.interval} steps, {args.steps}-step segments, {args.repeats} A/B pairs per "
        f"measurement, {args.rounds} alternating rounds per configuration (median, min – max).",
        f"Study: {len(study.trials)} trials in {tuning_s / 60:.1f} min, objective "
        f"{tuner.objectives}; best trial {best.number}.",
        "",
    ]
    table = []
    for label, key, scale in metrics:
        d, t = med("default", key), med("tuned", key)
        ratio = f"{t / d:.2f}" if d > 0 else "n/a (default ≤ 0)"
        table.append([label, spread("default", key, scale), spread("tuned", key, scale), ratio])
    lines += table_lines(["metric", "default", "tuned", "ratio tuned / default"], table)
    diff = {k: (v, tuned.to_dict()[k]) for k, v in default.to_dict().items()}
    knobs = [[k, a, b] for k, (a, b) in diff.items() if a != b]
    lines += ["", *table_lines(["engine knob", "default", "tuned"], knobs)]
    lines += [
        "",
        "Overhead = median over back-to-back segment pairs of (step time with checkpoints / "
        "without) - 1, on the same model in the same process (pcframe.apps.tuning.measure); it "
        "holds the stall and the slowdown of training while writer threads share the CPUs. "
        "A negative value is measurement noise around zero.",
        "",
    ]
    write_results(out / "tune_tuned_vs_default.md", "\n".join(lines))
    study_header = header("The tuning study behind tune_tuned_vs_default.md", command)
    write_results(
        out / "tune_study.md",
        "\n".join(study_header) + "\n" + trials_table(study, tuner.objectives),
    )
    plot(study, tuner.objectives, out / "tune_study.png")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
