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

from pcframe.apps.bounds import check_bounds
from pcframe.apps.compose import quiet_missing_user_conf
from pcframe.apps.errors import reported, run_app
from pcframe.apps.instantiate import check_targets
from pcframe.apps.limits import measure_limits
from pcframe.apps.machine import resolve_threads
from pcframe.apps.paths import user_config_dir
from pcframe.apps.schemas import register_app_schemas
from pcframe.apps.tuning import (
    Tuner,
    best_trial,
    fixed_knobs,
    limit_lines,
    plot,
    trials_table,
    write_tuned_config,
)
from pcframe.apps.tuning.measure import check_schedule
from pcframe.apps.tuning.target_storage import ActiveTarget, TargetSpec, open_target
from pcframe.errors import ConfigError
from pcframe.text import markdown_code

register_app_schemas()


def finish(
    tuner: Tuner, study: optuna.Study, target: ActiveTarget | None = None
) -> tuple[dict[str, Path], list[str]]:
    """Write the trials table, the plot and (if asked) the tuned engine config.

    Returns the files written and the lines stating the best trial against the machine's
    limits (one memcpy of the checkpoint, the disk's synced write rate), measured now
    (inside ``target``, when one is set up: a throttled disk's limit is the throttle).
    """
    tune = tuner.tune
    out = Path(tune.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {"table": out / "tune_trials.md", "plot": out / "tune_plot.png"}
    table = trials_table(study, tuner.objectives)
    title = f"# pcframe-tune study {markdown_code(study.study_name)}\n\n"
    try:
        best = best_trial(study, tuner.objectives)
    except ValueError:
        written["table"].write_text(f"{title}{table}")
        raise ConfigError(
            f"study {study.study_name!r} has no completed trial: every trial was pruned or "
            "failed; loosen tune.memory_budget or widen tune.space (see the table in "
            f"{written['table']})"
        ) from None
    directory = Path(tuner.cfg.storage.directory)
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = int(best.user_attrs.get("checkpoint_bytes") or 0)
    limits = measure_limits(directory, nbytes, repeats=3) if nbytes else None
    against = limit_lines(best, limits)
    if target is not None:
        against += target.remote_lines(nbytes)
    written["table"].write_text(title + "".join(f"- {line}\n" for line in against) + f"\n{table}")
    plot(study, tuner.objectives, written["plot"])
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
            target=target.identity() if target is not None else None,
        )
    return written, against


def check_config_path(path: str | None) -> None:
    """``tune.write_config`` where ``pcframe-run engine=NAME`` will find it, checked before
    the study runs: Hydra looks up ``<dir>/engine/NAME.yaml`` in a search path folder."""
    if path and (Path(path).suffix != ".yaml" or Path(path).parent.name != "engine"):
        where = Path(path)
        fixed = where.parent / "engine" / f"{where.stem or 'tuned'}.yaml"
        raise ConfigError(
            f"tune.write_config={path}: pcframe-run reads a tuned engine as "
            f"<folder>/engine/<name>.yaml (engine=<name>); write it to e.g. {fixed}"
        )


@hydra.main(version_base="1.3", config_path="pkg://pcframe.conf", config_name="tune")
def _app(cfg: DictConfig) -> None:
    with reported("pcframe-tune"):
        _task(cfg)


def _task(cfg: DictConfig) -> None:
    check_targets(cfg)
    check_bounds(cfg, "tune")
    check_schedule(cfg.tune.interval, cfg.tune.steps, cfg.tune.repeats)
    check_config_path(cfg.tune.write_config)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the tuner prints its own lines
    task = list(HydraConfig.get().overrides.task)
    console = Console()
    spec = TargetSpec.from_config(cfg.tune.target)
    # The target is set up for the whole study and the limits measured at the end (a
    # throttled disk: this process stays in the cgroup; s3: the server runs throughout).
    with open_target(spec, cfg.storage.directory) as target:
        tuner = Tuner(
            cfg,
            compose=lambda extra: hydra.compose("tune", overrides=[*task, *extra]),
            fixed=fixed_knobs(task),
            console=console,
            tiers=target.tiers,
        )
        study = tuner.run()
        written, against = finish(tuner, study, target)
    best = best_trial(study, tuner.objectives)
    console.print(f"best trial {best.number}: {best.params}")
    for line in against:
        console.print(line, soft_wrap=True)
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
