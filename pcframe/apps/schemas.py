"""Dataclass schemas registered in Hydra's ConfigStore so bad keys and types fail at compose time.

Every config group has a schema: a YAML option lists it first in its defaults list
(``defaults: [engine_schema, _self_]``), so a misspelt key or a value of the wrong type is
rejected by OmegaConf while Hydra composes, with the full key in the message. Groups whose
options carry a ``_target_`` (the policies) are checked against the target's signature by
:mod:`pcframe.apps.instantiate` right after composing.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from pcframe.apps.workloads import WORKLOADS
from pcframe.config import EngineConfig

# OmegaConf validates these annotation types itself; anything else becomes Any.
_PLAIN = (int, float, bool, str)


def signature_schema(name: str, fn: Any) -> type:
    """A dataclass with one field per keyword parameter of ``fn`` (types and defaults kept).

    Used for the workloads, so their configs can never drift from the factory functions.
    """
    hints = typing.get_type_hints(fn)
    fields = []
    for param in inspect.signature(fn).parameters.values():
        annotation = hints.get(param.name, Any)
        if annotation not in _PLAIN:
            annotation = Any
        default = MISSING if param.default is inspect.Parameter.empty else param.default
        fields.append((param.name, annotation, field(default=default)))
    return dataclasses.make_dataclass(name, fields)


@dataclass
class StorageConfig:
    """Where ``pcframe-run`` and ``pcframe-tune`` write checkpoints."""

    directory: str = MISSING


@dataclass
class FailureConfig:
    """Preemption injection (``failure=none``): train in-process, no kills."""

    kind: str = "none"


@dataclass
class InjectedFailure(FailureConfig):
    """What every injecting mode shares.

    Attributes:
        restart_delay: seconds between a kill and the restart (a replacement VM booting).
        max_kills: stop injecting after this many kills (the run then finishes).
        reference: also train once without kills, to measure the ideal time and this
            machine's speed (start-up, step time, time to durable), and to check that the
            final model is bit-identical (built-in workloads are deterministic).
        timeout: give up (error) when the whole supervised run takes longer, in seconds.
        target_kills: a derived schedule (``mtbf`` / ``compression`` null) puts kills
            ``training / target_kills`` seconds apart on average, counted in training
            seconds (start-ups and restart delays do not count; see
            :mod:`pcframe.apps.preemption.plan`): the larger, the more kills land.
        check: refuse, naming the keys to change, a schedule under which no kill would land
            or no checkpoint would commit before a kill (estimated from the reference run).
    """

    restart_delay: float = 0.0
    max_kills: int = 20
    reference: bool = True
    timeout: float = 3600.0
    target_kills: float = 4.0
    check: bool = True


@dataclass
class PoissonFailure(InjectedFailure):
    """Kills at exponentially distributed intervals of mean ``mtbf`` wall seconds
    (``null``: derived from the reference run, see ``target_kills``)."""

    kind: str = "poisson"
    mtbf: float | None = None
    seed: int = 0


@dataclass
class TraceFailure(InjectedFailure):
    """Kills at the preemptions of a recorded spot trace, time-compressed.

    Attributes:
        path: a trace file in any format :func:`pcframe.policies.traces.load_trace` reads
            (SkyNomad, Bamboo, PCcheck, pcframe CSV/JSON); kills happen where the up-count drops.
        times: explicit kill times in trace seconds, instead of ``path``.
        compression: trace seconds per wall second (3600: one trace hour per second);
            ``null``: derived from the reference run so that the trace's kills come
            ``training / target_kills`` training seconds apart on average.
        offset: skip this many trace seconds from the start of the trace.
    """

    kind: str = "trace"
    path: str | None = None
    times: list[float] | None = None
    compression: float | None = None
    offset: float = 0.0


@dataclass
class RunConfig:
    """Primary config of ``pcframe-run`` (``conf/run.yaml``)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    workload: Any = MISSING
    policy: Any = MISSING
    failure: Any = MISSING
    steps: int = 300
    # torch threads: a number, or auto (usable CPUs minus one for the engine; apps/machine.py)
    threads: int | str = "auto"
    baseline: bool = True
    # runs without checkpointing (the first half before the checkpointed run, the rest
    # after); the overhead gets a ± (their standard deviation) only from 3 on (summary.py)
    baseline_runs: int = 2
    progress: bool = True
    directory: str = "${storage.directory}"


@dataclass
class TuneConfig:
    """The ``tune`` group: the study, the objective and the search space (see docs/tuning.md)."""

    study_name: str = "pcframe-engine"
    storage: str | None = "sqlite:///pcframe-tune.db"
    n_trials: int = 30
    timeout: float | None = None
    objectives: list[str] = field(default_factory=lambda: ["overhead"])
    interval: int = 10
    steps: int = 20
    repeats: int = 8
    warmup_steps: int = 5
    memory_budget: int | None = None
    sampler: str = "tpe"
    seed: int | None = 0
    pruner: str = "median"
    pruner_startup_trials: int = 3
    confirm: int = 3
    heartbeat: int | None = 10
    # knob -> {type, low, high, step, log, choices, values}; checked by
    # pcframe.apps.tuning.space.parse_space (untyped here so knobs can be added on the command line)
    space: dict[str, Any] = field(default_factory=dict)
    write_config: str | None = None
    report_dir: str = "."
    progress: bool = True
    # the storage measured on (conf/tune/target/: {name, kind, ...}); checked by
    # pcframe.apps.tuning.target_storage.TargetSpec.from_config, untyped so each kind has its keys
    target: Any = None


@dataclass
class TuneAppConfig:
    """Primary config of ``pcframe-tune`` (``conf/tune.yaml``)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    workload: Any = MISSING
    tune: TuneConfig = field(default_factory=TuneConfig)
    threads: int | str = "auto"


def workload_schemas() -> dict[str, type]:
    """``{workload name: schema}``: ``name`` fixed, ``args`` typed from the factory."""
    schemas = {}
    for name, factory in WORKLOADS.items():
        args = signature_schema(f"{name.title()}Args", factory)
        schemas[name] = dataclasses.make_dataclass(
            f"{name.title()}WorkloadConfig",
            [("name", str, field(default=name)), ("args", args, field(default_factory=args))],
        )
    return schemas


def register_app_schemas() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent), the help resolver, and a
    config option for every registered policy without a YAML (entry-point plugins)."""
    from pcframe.apps.errors import register_resolvers
    from pcframe.apps.plugins import register_policy_configs

    register_resolvers()
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    store.store(name="tune_app_schema", node=TuneAppConfig)
    store.store(group="engine", name="engine_schema", node=EngineConfig)
    store.store(group="storage", name="storage_schema", node=StorageConfig)
    store.store(group="failure", name="none_schema", node=FailureConfig)
    store.store(group="failure", name="poisson_schema", node=PoissonFailure)
    store.store(group="failure", name="trace_schema", node=TraceFailure)
    store.store(group="tune", name="tune_schema", node=TuneConfig)
    for name, schema in workload_schemas().items():
        store.store(group="workload", name=f"{name}_schema", node=schema)
    register_policy_configs()
