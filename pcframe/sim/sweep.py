"""Many simulations at once: traces x policies x parameters, with a progress bar."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pcframe.policies.base import IntervalPolicy
from pcframe.policies.placement import PlacementPolicy
from pcframe.policies.predictors.base import Predictor
from pcframe.policies.resource import ResourcePolicy
from pcframe.policies.traces import Trace
from pcframe.sim.baselines import best_fixed_interval
from pcframe.sim.result import SimResult
from pcframe.sim.simulator import simulate
from pcframe.sim.spec import JobSpec, SimOptions

BEST_FIXED = "best_fixed"


@dataclass(frozen=True)
class Case:
    """One simulation: a trace, the job, and factories that build fresh policies.

    Policies learn while they run, so every case builds its own from a factory taking the
    trace (a policy may be configured from it, e.g. Young with the trace's MTBF).
    ``interval="best_fixed"`` searches the best ``FixedSteps`` interval in hindsight instead.
    ``placement`` (a factory too: placements may learn) turns on the per-tier restart model
    (:mod:`pcframe.sim.tiers`).
    """

    trace: Trace
    label: str
    interval: Callable[[Trace], IntervalPolicy] | str
    job: JobSpec = field(default_factory=JobSpec)
    resource: Callable[[Trace], ResourcePolicy] | None = None
    predictor: Callable[[Trace], Predictor] | None = None
    options: SimOptions = field(default_factory=SimOptions)
    params: dict[str, Any] = field(default_factory=dict)
    placement: Callable[[Trace], PlacementPolicy] | None = None


def run_case(case: Case) -> SimResult:
    """Simulate one case (a hindsight search for ``best_fixed``)."""
    if case.interval == BEST_FIXED:
        # Every candidate interval gets fresh (stateful) resource policies and predictors.
        def run(policy: IntervalPolicy) -> SimResult:
            return simulate(
                case.trace,
                policy,
                case.job,
                case.resource(case.trace) if case.resource else None,
                case.predictor(case.trace) if case.predictor else None,
                case.options,
                placement=case.placement(case.trace) if case.placement else None,
            )

        every, result, _ = best_fixed_interval(run, case.job, case.trace.duration)
        params = {**case.params, "every": every}
        return _relabel(result, case.label, params)
    if isinstance(case.interval, str):
        raise ValueError(f"unknown baseline {case.interval!r}; use {BEST_FIXED!r} or a factory")
    return simulate(
        case.trace,
        case.interval(case.trace),
        case.job,
        case.resource(case.trace) if case.resource else None,
        case.predictor(case.trace) if case.predictor else None,
        case.options,
        params=case.params,
        label=case.label,
        placement=case.placement(case.trace) if case.placement else None,
    )


def _relabel(result: SimResult, label: str, params: dict[str, Any]) -> SimResult:
    return replace(result, label=label, params=params)


def run_cases(
    cases: Sequence[Case], progress: bool = True, description: str = "simulating"
) -> list[SimResult]:
    """Run every case in order, with a rich progress bar (disable for tests and logs)."""
    results: list[SimResult] = []
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[now]}"),
    )
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task(description, total=len(cases), now="")
        for case in cases:
            bar.update(task, now=f"{case.trace.name} / {case.label}")
            results.append(run_case(case))
            bar.advance(task)
    return results


def grid(**axes: Iterable[Any]) -> list[dict[str, Any]]:
    """Cartesian product of named axes as a list of dicts (parameter sweeps)."""
    points: list[dict[str, Any]] = [{}]
    for name, values in axes.items():
        points = [{**p, name: v} for p in points for v in values]
    return points
