"""The tuner: an Optuna study whose trials compose a config, build the engine and measure it."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import torch
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pcframe.apps.compose import engine_config
from pcframe.apps.machine import resolve_threads
from pcframe.apps.tuning.measure import OBJECTIVES, Measurement, measure
from pcframe.apps.tuning.report import UNITS, groups, mean_value
from pcframe.apps.tuning.space import (
    Knob,
    base_params,
    check_space,
    engine_values,
    overrides,
    parse_space,
    split_containers,
    suggest,
)
from pcframe.apps.tuning.storage import open_storage
from pcframe.apps.tuning.trial_dirs import held_trial, remove_orphaned_trials
from pcframe.apps.workloads import build
from pcframe.config import EngineConfig
from pcframe.errors import CheckpointError, ConfigError

SAMPLERS = ("tpe", "random", "nsga2")
PRUNERS = ("median", "none")
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)

Compose = Callable[[list[str]], DictConfig]


class Tuner:
    """Runs (or resumes) the study described by a composed ``pcframe-tune`` config.

    Args:
        cfg: the composed ``tune`` app config (``conf/tune.yaml``).
        compose: builds the full config for a list of extra overrides (one trial's
            ``engine.<knob>=<value>``); inside the app this is Hydra's compose API.
        fixed: engine knobs pinned on the command line, left out of the search.
        tiers: replica tiers for a trial, by label (the ``s3`` target's remote prefix).
    """

    def __init__(
        self,
        cfg: DictConfig,
        compose: Compose,
        *,
        fixed: set[str] = frozenset(),
        console: Console | None = None,
        tiers: Callable[[str], dict[str, Any] | None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.tiers = tiers
        self.tune = cfg.tune
        self.compose = compose
        self.console = console or Console()
        self.objectives = list(self.tune.objectives)
        bad = [o for o in self.objectives if o not in OBJECTIVES]
        if not self.objectives or bad or len(set(self.objectives)) != len(self.objectives):
            raise ConfigError(
                f"tune.objectives={self.objectives} is invalid: list one or more distinct "
                f"names from {', '.join(OBJECTIVES)}"
            )
        if self.tune.sampler not in SAMPLERS:
            raise ConfigError(f"tune.sampler={self.tune.sampler!r}: use one of {SAMPLERS}")
        if self.tune.pruner not in PRUNERS:
            raise ConfigError(f"tune.pruner={self.tune.pruner!r}: use one of {PRUNERS}")
        name = self.tune.study_name
        if not str(name).strip():
            raise ConfigError(
                f"tune.study_name={name!r}: give the study a name (it is how a stored study "
                "is found again; the default is pcframe-engine)"
            )
        if self.tune.n_trials < 1:
            raise ConfigError(f"tune.n_trials={self.tune.n_trials}: run at least 1 trial")
        self.knobs: list[Knob] = parse_space(self.tune.space, set(fixed))
        self.base_engine = engine_config(cfg)
        self.base_engine.check_runtime()  # the first trial measures it: refused up front
        check_space(self.knobs, self.base_engine)
        self._progress: Progress | None = None
        self._task: Any = None

    @property
    def multi(self) -> bool:
        return len(self.objectives) > 1

    # --- the study -------------------------------------------------------------------

    def create_study(self, enqueue_base: bool = True) -> optuna.Study:
        """Create the study, or load it from the storage to resume it.

        A new study's first trial measures the base engine (``enqueue_base``), so the result
        is never worse than the configuration the search started from.
        """
        tune = self.tune
        storage = open_storage(tune.storage, tune.heartbeat)
        if tune.sampler == "tpe":
            sampler: optuna.samplers.BaseSampler = optuna.samplers.TPESampler(seed=tune.seed)
        elif tune.sampler == "random":
            sampler = optuna.samplers.RandomSampler(seed=tune.seed)
        else:
            sampler = optuna.samplers.NSGAIISampler(seed=tune.seed)
        # Optuna prunes single-objective studies only; a multi-objective trial is still cut
        # short when it breaks the memory budget (see _check_memory).
        if tune.pruner == "median" and not self.multi:
            # The first pairs of a trial are a noisy estimate: judge after half of them.
            pruner: optuna.pruners.BasePruner = optuna.pruners.MedianPruner(
                n_startup_trials=tune.pruner_startup_trials,
                n_warmup_steps=tune.repeats // 2,
            )
        else:
            pruner = optuna.pruners.NopPruner()
        study = optuna.create_study(
            storage=storage,
            study_name=tune.study_name,
            directions=["minimize"] * len(self.objectives),
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,
        )
        if len(study.directions) != len(self.objectives):
            raise ConfigError(
                f"study {tune.study_name!r} in {tune.storage} has {len(study.directions)} "
                f"objective(s), but tune.objectives={self.objectives}; pick another "
                "tune.study_name or the objectives it was created with"
            )
        if enqueue_base and not study.trials:
            base = base_params(self.base_engine, self.knobs)
            outside = [k.name for k in self.knobs if k.name not in base]
            if outside:
                values = self.base_engine.to_dict()
                self.console.print(
                    "[yellow]note:[/yellow] the base engine's "
                    + ", ".join(f"{n}={values[n]!r}" for n in outside)
                    + " lie outside tune.space, so trial 0 samples them and does not measure "
                    "the base exactly; add them to the ranges to compare against the base"
                )
            if base:
                study.enqueue_trial(base, user_attrs={"base": True}, skip_if_exists=True)
        return study

    def finished(self, study: optuna.Study) -> int:
        return len(study.get_trials(deepcopy=False, states=FINISHED))

    def run(self, study: optuna.Study | None = None) -> optuna.Study:
        """Run trials until ``tune.n_trials`` have finished in the study (all workers)."""
        study = study or self.create_study()
        for folder in remove_orphaned_trials(Path(self.cfg.storage.directory)):
            self.console.print(f"removed {folder}: its trial's process no longer runs")
        remaining = self.tune.n_trials - self.finished(study)
        if remaining <= 0:
            self.console.print(
                f"study {study.study_name!r} already has {self.finished(study)} finished "
                f"trials (tune.n_trials={self.tune.n_trials}); no new search trials"
            )
            self.confirm(study)  # in case the run that searched stopped before confirming
            return study
        stop = optuna.study.MaxTrialsCallback(self.tune.n_trials, states=FINISHED)
        with Progress(
            TextColumn("[bold]tuning[/bold] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.tune.progress,
        ) as progress:
            self._progress = progress
            confirm = 0 if self.multi else self.tune.confirm
            self._task = progress.add_task(
                study.study_name,
                total=self.tune.n_trials + confirm + (confirm > 0),
                completed=self.finished(study),
            )
            study.optimize(
                self.objective,
                n_trials=remaining,
                timeout=self.tune.timeout,
                callbacks=[stop, self._on_trial],
                # A configuration this machine cannot run (O_DIRECT refused, disk full) is a
                # failed trial, not the end of the study.
                catch=(CheckpointError, OSError),
            )
            self.confirm(study)
        return study

    def confirm(self, study: optuna.Study) -> None:
        """Measure the ``tune.confirm`` best configurations and the base once more.

        :func:`~pcframe.apps.tuning.report.best_trial` then picks by the mean among configurations
        measured twice, so one that won on a lucky measurement does not become the tuned
        config, and the base engine stays unless something beats it on the same terms.
        (Single objective only.)
        """
        if self.multi or self.tune.confirm <= 0:
            return
        measured = groups(study)
        chosen = sorted(measured, key=mean_value)[: self.tune.confirm]
        chosen += [
            g for g in measured if g not in chosen and any(t.user_attrs.get("base") for t in g)
        ]
        todo = [g[0].params for g in chosen if len(g) < 2]
        for params in todo:
            study.enqueue_trial(params, user_attrs={"confirmation": True})
        if todo:
            study.optimize(
                self.objective,
                n_trials=len(todo),
                callbacks=[self._on_trial],
                catch=(CheckpointError, OSError),
            )

    # --- one trial -------------------------------------------------------------------

    def trial_config(self, params: dict[str, Any]) -> tuple[DictConfig, EngineConfig]:
        """The composed config and engine of a trial's parameters (as Optuna stores them)."""
        plain, containers = split_containers(engine_values(self.knobs, params))
        cfg = self.compose(overrides(plain))
        for name, value in containers.items():
            # Replaced, not merged: the schema still checks the type of the new value.
            OmegaConf.update(cfg, f"engine.{name}", value, merge=False)
        return cfg, engine_config(cfg)

    def objective(self, trial: optuna.Trial) -> float | tuple[float, ...]:
        params = suggest(trial, self.knobs)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        try:
            cfg, engine = self.trial_config(params)
        except ConfigError as exc:  # e.g. a staging budget below one chunk: no such engine
            trial.set_user_attr("pruned_because", str(exc))
            raise optuna.TrialPruned(str(exc)) from None
        torch.set_num_threads(resolve_threads(cfg.threads))
        workload = build(cfg.workload.name, **OmegaConf.to_container(cfg.workload.args))
        with held_trial(Path(cfg.storage.directory), trial.number) as directory:
            result = measure(
                workload,
                engine,
                directory,
                interval=self.tune.interval,
                steps=self.tune.steps,
                repeats=self.tune.repeats,
                warmup_steps=self.tune.warmup_steps,
                on_memory=lambda nbytes: self._check_memory(trial, nbytes),
                on_repeat=lambda i, so_far: self._report(trial, i, so_far),
                tiers=self.tiers(f"trial-{trial.number}") if self.tiers else None,
            )
        for key, value in result.summary().items():
            trial.set_user_attr(key, value)
        values = tuple(result.objective(o) for o in self.objectives)
        return values if self.multi else values[0]

    def _check_memory(self, trial: optuna.Trial, nbytes: int) -> None:
        trial.set_user_attr("memory_bytes", float(nbytes))
        budget = self.tune.memory_budget
        if budget is not None and nbytes > budget:
            reason = f"staging memory {nbytes} B is over tune.memory_budget={budget} B"
            trial.set_user_attr("pruned_because", reason)
            raise optuna.TrialPruned(reason)

    def _report(self, trial: optuna.Trial, repeat: int, so_far: Measurement) -> None:
        if self.multi:
            return
        trial.report(so_far.objective(self.objectives[0]), repeat)
        if trial.should_prune():
            trial.set_user_attr("pruned_because", f"worse than the median after {repeat + 1}")
            raise optuna.TrialPruned()

    def _on_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        values = trial.values or []
        shown = "  ".join(
            f"{UNITS[o][0]} {v * UNITS[o][1]:.2f}"
            for o, v in zip(self.objectives, values, strict=False)
        )
        why = trial.user_attrs.get("pruned_because", "")
        self.console.print(
            f"trial {trial.number:>3} {trial.state.name.lower():<8} {shown or why}  {trial.params}"
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=self.finished(study))
