"""``pcframe-tune``: search the engine's knobs with Optuna, write the best as ``engine=tuned``.

A Hydra app whose trials use Hydra's compose API: every trial composes ``conf/tune.yaml``
with the command line's overrides plus its own ``engine.<knob>=<value>``, so a trial's
engine is validated exactly as ``pcframe-run`` would validate it.
"""

from __future__ import annotations

from pathlib import Path

import hydra
import optuna
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from pcframe.apps.compose import quiet_missing_user_conf
from pcframe.apps.errors import reported, run_app
from pcframe.apps.machine import resolve_threads
from pcframe.apps.paths import user_config_dir
from pcframe.apps.schemas import register
from pcframe.apps.targets import check_targets
from pcframe.apps.tuning import (
    Tuner,
    best_trial,
    fixed_knobs,
    plot,
    trials_table,
    write_tuned_config,
)
from pcframe.errors import ConfigError

register()


def finish(tuner: Tuner, study: optuna.Study) -> dict[str, Path]:
    """Write the trials table, the plot and (if asked) the tuned engine config."""
    tune = tuner.tune
    out = Path(tune.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {"table": out / "tune_trials.md", "plot": out / "tune_plot.png"}
    written["table"].write_text(
        f"# pcframe-tune study `{study.study_name}`\n\n" + trials_table(study, tuner.objectives)
    )
    plot(study, tuner.objectives, written["plot"])
    try:
        best = best_trial(study, tuner.objectives)
    except ValueError:
        raise ConfigError(
            f"study {study.study_name!r} has no completed trial: every trial was pruned or "
            "failed; loosen tune.memory_budget or widen tune.space (see the table in "
            f"{written['table']})"
        ) from None
    if tune.write_config:
        cfg, engine = tuner.trial_config(dict(best.params))
        workload = {"name": cfg.workload.name, "args": OmegaConf.to_container(cfg.workload.args)}
        written["config"] = write_tuned_config(
            tune.write_config,
            engine,
            study,
            best,
            tuner.objectives,
            workload=workload,
            threads=resolve_threads(cfg.threads),
        )
    return written


@hydra.main(version_base="1.3", config_path="pkg://pcframe.conf", config_name="tune")
def _app(cfg: DictConfig) -> None:
    with reported("pcframe-tune"):
        _task(cfg)


def _task(cfg: DictConfig) -> None:
    check_targets(cfg)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the tuner prints its own lines
    task = list(HydraConfig.get().overrides.task)
    console = Console()
    tuner = Tuner(
        cfg,
        compose=lambda extra: hydra.compose("tune", overrides=[*task, *extra]),
        fixed=fixed_knobs(task),
        console=console,
    )
    study = tuner.run()
    written = finish(tuner, study)
    best = best_trial(study, tuner.objectives)
    console.print(f"best trial {best.number}: {best.params}")
    for what, path in written.items():
        console.print(f"{what}: {path}")
    if "config" in written:
        path = written["config"].resolve()
        use = f"pcframe-run engine={path.stem}"
        if path.parent.parent != user_config_dir():
            use = f"PCFRAME_CONFIG_DIR={path.parent.parent} {use}"
        console.print(f"use it: {use}", soft_wrap=True)
        console.print(
            f"(engine options are looked up in $PCFRAME_CONFIG_DIR, default ./pcframe-conf: "
            f"from another folder, set PCFRAME_CONFIG_DIR={path.parent.parent})",
            soft_wrap=True,
        )


def main() -> None:
    quiet_missing_user_conf()
    run_app(_app, "pcframe-tune")


if __name__ == "__main__":
    main()
