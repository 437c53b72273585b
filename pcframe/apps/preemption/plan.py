"""A kill schedule that fits this machine: derived from an uninterrupted run, then checked.

A fixed schedule cannot suit every machine: on a fast one a run of a few hundred steps is
over before a kill every 30 s begins, on a loaded one a checkpoint every 100 steps comes
less often than the kills, so no process lives to commit one. The supervised mode of
``pcframe-run`` therefore first trains once without kills (the reference run), measures
start-up time, step time and time to durable, and then

* derives what was left open: ``failure.mtbf=null`` (Poisson) and ``failure.compression=null``
  (a trace) become a mean gap between kills of ``training / failure.target_kills`` seconds
  on the training clock (:class:`KillClock`: start-ups and restart delays do not count), so
  about ``target_kills`` kills land and every process trains for a while, however long its
  start-up took (a cold page cache for the reference run, a loaded machine later);
  a ``FixedSteps`` interval that was not set explicitly is lowered so that about four
  checkpoints commit between two kills;
* estimates, with a small model of the supervised run, how many kills land and how many
  checkpoints commit before a kill, and refuses (naming the keys to change) a schedule in
  which no kill lands or no checkpoint commits in time (``failure.check=false`` runs it
  anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from pcframe.apps.preemption.schedule import derived, kill_times, trace_compression
from pcframe.apps.preemption.supervisor import KillClock, Life
from pcframe.errors import ConfigError

CHECKPOINTS_PER_LIFE = 4  # a derived FixedSteps interval fits this many between two kills


@dataclass
class Measured:
    """What the uninterrupted reference run showed about this machine."""

    steps: int
    startup: float  # seconds from spawn to the end of the first step
    step_seconds: float
    commits: int
    durable: float  # mean seconds from save() to committed
    wall: float

    @property
    def training(self) -> float:
        return self.steps * self.step_seconds

    @classmethod
    def from_life(cls, life: Life, steps: int) -> Measured:
        startup = life.startup_seconds or 0.0
        trained = max(1, steps - 1)  # the first step is inside the start-up
        step_seconds = max(life.training_seconds, 1e-6) / trained
        done = life.done or {}
        commits = int(done.get("checkpoints", life.commits))
        durable = float(done.get("durable", 0.0)) / commits if commits else 0.0
        return cls(steps, startup, step_seconds, commits, durable, life.ended - life.spawned)


@dataclass
class KillEstimate:
    """The supervised run as the model expects it."""

    landed: int = 0  # kills that hit a running process
    commits_before_kills: int = 0  # checkpoints committed by processes that were killed
    first_kill: float | None = None


@dataclass
class KillPlan:
    times: list[float]
    schedule: str  # for the summary, e.g. "poisson, mean gap 6.3 s (derived)"
    mean_gap: float | None
    every: int | None = None  # the FixedSteps interval to run with (None: as configured)
    clock: KillClock = KillClock.JOB  # what ``times`` count (derived: training seconds)
    interval: str = ""  # how it was chosen, for the summary
    estimate: KillEstimate = field(default_factory=KillEstimate)


def target_gap(failure: Any, measured: Measured) -> float:
    """The mean gap of a derived schedule, in training seconds."""
    kills = failure.target_kills
    if not (isinstance(kills, int | float) and kills > 0):
        raise ConfigError(f"failure.target_kills={kills!r} is invalid: give a number > 0, e.g. 4")
    return measured.training / kills


def plan(
    failure: Any,
    measured: Measured | None,
    *,
    every: int | None = None,
    every_pinned: bool = True,
) -> KillPlan:
    """The kill times (and FixedSteps interval) for ``failure``; see the module docstring.

    ``every`` is the configured ``FixedSteps`` interval (``None`` for other policies);
    ``every_pinned`` says it was set on purpose (command line, experiment), so it stays.
    """
    if failure.kind not in ("poisson", "trace"):
        raise ConfigError(f"failure.kind={failure.kind!r} is unknown; use none, poisson or trace")
    if derived(failure) and measured is None:
        key = "failure.mtbf" if failure.kind == "poisson" else "failure.compression"
        raise ConfigError(
            f"{key}=null derives the kill schedule from an uninterrupted run: keep "
            f"failure.reference=true, or give {key}=<number>"
        )
    clock = KillClock.TRAINING if derived(failure) else KillClock.JOB
    gap = target_gap(failure, measured) if derived(failure) else None
    how = f" (derived: {_derivation(failure, measured)})" if gap is not None else ""
    unit = clock.unit
    times = kill_times(failure, gap)
    if failure.kind == "poisson":
        gap = gap if failure.mtbf is None else failure.mtbf
        schedule = f"poisson, mean gap {gap:.1f}{unit}{how}"
    else:
        compression = failure.compression
        if compression is None:
            compression = trace_compression(failure, gap)
        gap = times[-1] / len(times) if times else None
        where = failure.path if failure.path is not None else f"times {list(failure.times)}"
        shown = f"mean gap {gap:.1f}{unit}, " if gap else ""
        schedule = f"trace {where}, {shown}compression {compression:,.4g}x{how}"
    result = KillPlan(times, schedule, gap, clock=clock)
    if measured is None:
        return result
    if every is not None and not every_pinned and gap is not None:
        # seconds a process trains between two kills (a start-up takes none on training time)
        starting = failure.restart_delay + measured.startup if clock is KillClock.JOB else 0.0
        living = gap - starting
        if living > 0:
            # ~4 checkpoints in each process's life, and at least 4 in the whole run
            per_life = living / (CHECKPOINTS_PER_LIFE * measured.step_seconds)
            derived_every = int(min(per_life, measured.steps / CHECKPOINTS_PER_LIFE))
            derived_every = max(1, min(every, derived_every))
            if derived_every < every:
                result.every = derived_every
                result.interval = (
                    f"derived: ~{CHECKPOINTS_PER_LIFE} between kills at "
                    f"{1e3 * measured.step_seconds:.0f} ms/step"
                )
    interval_steps = result.every or every or _reference_interval(measured)
    result.estimate = estimate(times, measured, failure.restart_delay, interval_steps, clock)
    return result


def _derivation(failure: Any, measured: Measured) -> str:
    return f"{measured.training:.1f} s training / {failure.target_kills:g}"


def _reference_interval(measured: Measured) -> float | None:
    return measured.steps / measured.commits if measured.commits else None


def estimate(
    times: list[float],
    measured: Measured,
    restart_delay: float,
    every: float | None,
    clock: KillClock = KillClock.JOB,
) -> KillEstimate:
    """Replay ``times`` against a model of the run: lives that start up, train at the measured
    step time, commit a checkpoint every ``every`` steps (durable after the measured time).
    On the training clock start-ups and restart delays take no time."""
    if clock is KillClock.TRAINING:
        measured = replace(measured, startup=0.0)
        restart_delay = 0.0
    result = KillEstimate(first_kill=times[0] if times else None)
    durable_step = 0.0
    now = 0.0
    pending = sorted(times)
    while True:
        train_from = now + measured.startup
        finish = train_from + (measured.steps - durable_step) * measured.step_seconds
        pending = [t for t in pending if t > now]  # kills while no process runs are skipped
        if not pending or pending[0] >= finish:
            return result
        kill = pending.pop(0)
        result.landed += 1
        if every and kill > train_from:
            reached = durable_step + (kill - train_from) / measured.step_seconds
            safe = reached - measured.durable / measured.step_seconds
            last = math.floor(safe / every) * every if safe > 0 else 0.0
            if last > durable_step:
                result.commits_before_kills += round((last - durable_step) / every) or 1
                durable_step = last
        now = kill + restart_delay


def check_plan(
    plan_: KillPlan, failure: Any, measured: Measured, policy: str, every: int | None
) -> None:
    """Refuse a schedule that cannot show what the mode is for (see the module docstring)."""
    if not failure.check:
        return
    fix_kills = {
        ("poisson", False): "use failure.mtbf=null (derived from this machine) or a smaller "
        "failure.mtbf",
        ("poisson", True): "raise steps, or try another failure.seed",
        ("trace", False): "use failure.compression=null (derived from this machine) or a "
        "larger failure.compression",
        ("trace", True): "raise steps, or lower failure.offset",
    }[(failure.kind, derived(failure))]
    note = "; failure.check=false runs it anyway"
    run = (
        f"a run without kills is over after {measured.wall:.1f} s ({measured.startup:.1f} s "
        f"start-up + {measured.training:.1f} s training)"
    )
    first = plan_.estimate.first_kill
    if plan_.estimate.landed == 0:
        unit = plan_.clock.unit
        when = f"the first kill comes at {first:.1f}{unit}, but " if first is not None else ""
        raise ConfigError(f"no kill would land: {when}{run}; {fix_kills}{note}")
    if measured.commits == 0 and (every is None or plan_.every is None):
        raise ConfigError(
            f"{policy} committed no checkpoint in an uninterrupted run of {measured.steps} "
            f"steps ({measured.training:.1f} s), so every killed process would start over; "
            f"{_interval_fix(every, measured)}{note}"
        )
    commits, landed = plan_.estimate.commits_before_kills, plan_.estimate.landed
    if 2 * commits < landed:  # fewer than one checkpoint per two kills: hardly any progress
        gap = f"{plan_.mean_gap:.1f} s" if plan_.mean_gap else "the schedule's gaps"
        starting = f"a process needs {measured.startup:.1f} s to start, and "
        starting = "" if plan_.clock is KillClock.TRAINING else starting
        raise ConfigError(
            f"kills would come faster than checkpoints commit: about {commits} checkpoint(s) "
            f"before {landed} kills (kills every {gap} on average; {starting}{policy} "
            "checkpoints less often); "
            f"{_interval_fix(every, measured)}, or give the kills more room (a larger "
            f"failure.mtbf / failure.compression, or null){note}"
        )


def _interval_fix(every: int | None, measured: Measured) -> str:
    if every is not None:
        suggestion = max(1, measured.steps // 20)
        return (
            f"lower policy.interval.every (e.g. policy.interval.every={suggestion}) or raise steps"
        )
    return "use a shorter interval (e.g. policy/interval=fixed_steps) or raise steps"
