"""Measure one engine configuration for real: this machine's disk, CPUs and memory.

A/B design: segments of ``steps`` training steps without checkpoints (A) and with a
checkpoint every ``interval`` steps (B) run back to back in pairs, AB BA AB ..., on the same
model in the same process. A segment with checkpoints is timed until its last checkpoint is
durable. Overhead is the median over pairs of B's step time / A's step time, minus one: it
holds both the stall the engine measures (training blocked on a save) and the slowdown of
training while writer threads compete for the CPUs.

Why pairs and a median: on a shared machine other processes come and go on a scale of
seconds to minutes. The two segments of a pair run within a few seconds of each other, so
slow drift cancels in their ratio; a burst that hits one segment spoils one pair, which the
median ignores. (Comparing each arm's fastest or median segment instead mixes load levels
minutes apart, and was wrong by tens of percent on a busy 2-core machine.)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcframe.apps.training import batches
from pcframe.apps.workloads import Workload
from pcframe.checkpointer import Checkpointer
from pcframe.config import EngineConfig
from pcframe.errors import ConfigError
from pcframe.policies.fixed import FixedSteps

OBJECTIVES = ("overhead", "stall", "cpu", "cost", "lost", "memory")


@dataclass
class Measurement:
    """What one configuration cost. Times in seconds, memory in bytes."""

    baseline_step: list[float] = field(default_factory=list)  # per A segment
    checkpoint_step: list[float] = field(default_factory=list)  # per B segment
    stalls: list[float] = field(default_factory=list)  # per checkpoint, engine-measured
    cpus: list[float] = field(default_factory=list)  # per checkpoint, engine-measured
    durable: list[float] = field(default_factory=list)  # per checkpoint, save() to committed
    memory: int = 0  # host staging pool actually allocated
    checkpoint_bytes: int = 0
    # per checkpoint: the seconds a B segment waited at its end for its versions to be
    # durable (and uploaded, with tiers), spread over its checkpoints: the backlog storage
    # still had, which a longer run would pay as stall once its in-flight slots fill up
    drains: list[float] = field(default_factory=list)

    @property
    def overhead(self) -> float:
        """Fractional slowdown of training at the target interval (0.05 = 5 % slower)."""
        pairs = zip(self.baseline_step, self.checkpoint_step, strict=True)
        return statistics.median(b / a for a, b in pairs) - 1

    @property
    def stall(self) -> float:
        """Mean seconds the training thread was blocked per checkpoint."""
        return statistics.fmean(self.stalls) if self.stalls else 0.0

    @property
    def cpu(self) -> float:
        """Median CPU seconds the engine's threads spent per checkpoint (all its stages).

        Read from per-thread CPU clocks inside the engine (``SaveRecord.cpu``), so training
        running beside it adds nothing, and other processes on the machine add little: the
        steadiest of the measurements on a shared computer. (Differencing the whole
        process's CPU time with and without checkpoints was tried first: the training
        threads' own CPU time varies by more than a checkpoint costs.)
        """
        return statistics.median(self.cpus) if self.cpus else 0.0

    @property
    def cost(self) -> float:
        """Training seconds lost per checkpoint when training uses every core: stall + CPU."""
        return self.stall + self.cpu

    @property
    def drain(self) -> float:
        """Mean seconds per checkpoint waited at a segment's end for storage to catch up."""
        return statistics.fmean(self.drains) if self.drains else 0.0

    @property
    def lost(self) -> float:
        """``cost`` + ``drain``: training seconds lost per checkpoint when storage must keep up.

        ``cost`` alone rewards a deep in-flight queue that only defers a slow disk's
        backlog past the segment; counting the wait for the last versions charges it back.
        """
        return self.cost + self.drain

    def objective(self, name: str) -> float:
        if name in ("overhead", "stall", "cpu", "cost", "lost"):
            return getattr(self, name)
        if name == "memory":
            return float(self.memory)
        raise ValueError(f"unknown objective {name!r}; use one of {', '.join(OBJECTIVES)}")

    def summary(self) -> dict[str, float]:
        return {
            "overhead": self.overhead,
            "stall_s": self.stall,
            "cpu_s": self.cpu,
            "cost_s": self.cost,
            "durable_s": statistics.fmean(self.durable) if self.durable else 0.0,
            "memory_bytes": float(self.memory),
            "checkpoint_bytes": float(self.checkpoint_bytes),
            "drain_s": self.drain,
            "lost_s": self.lost,
            "baseline_step_s": statistics.median(self.baseline_step),
            "checkpoint_step_s": statistics.median(self.checkpoint_step),
        }


def measure(
    workload: Workload,
    engine: EngineConfig,
    directory: str | Path,
    *,
    interval: int,
    steps: int,
    repeats: int,
    warmup_steps: int = 5,
    on_memory: Callable[[int], None] | None = None,
    on_repeat: Callable[[int, Measurement], None] | None = None,
    tiers: dict[str, Any] | None = None,
    timed_drain: bool = True,
) -> Measurement:
    """Measure ``engine`` on ``workload`` (see the module docstring).

    ``tiers``: replica tiers (``Checkpointer(tiers=...)``, e.g. a remote store); a
    checkpointed segment then ends when its versions are on every tier, so an upload that
    cannot keep up with the interval shows in the segment's step time.
    ``timed_drain=False`` measures training alone, as a long run sees it: saves fall in the
    middle of each interval (so the last one's write overlaps timed steps like the others)
    and the wait for them at a segment's end is not timed (the tuner times it: a backlog a
    configuration leaves is its cost there).
    ``on_memory(bytes)`` is called once the staging pool is sized (after one untimed save),
    ``on_repeat(i, so_far)`` after each A/B pair; either may raise to stop early (pruning).
    """
    check_schedule(interval, steps, repeats)
    result = Measurement()
    stream = batches(workload)
    step = 0
    phase = 0 if timed_drain else interval // 2  # where in an interval a save falls

    def segment(save: bool) -> float:
        nonlocal step
        begin = time.perf_counter()
        for _ in range(steps):
            step += 1
            workload.train_step(next(stream))
            if save and step % interval == phase:
                ckpt.save(step)
        trained = time.perf_counter()
        if save:
            ckpt.wait()  # the segment ends when its checkpoints are durable
            if tiers:
                ckpt.tiers.wait_idle()  # ... and on every replica tier
            saves = steps // interval
            result.drains += [(time.perf_counter() - trained) / saves] * saves
        end = time.perf_counter() if timed_drain else trained
        return (end - begin) / steps

    with Checkpointer(
        directory,
        model=workload.model,
        optimizer=workload.optimizer,
        scheduler=workload.scheduler,
        data=workload.loader,
        policy=FixedSteps(10**9),  # saves are triggered here, not by a policy
        config=engine,
        tiers=tiers,
    ) as ckpt:
        for _ in range(warmup_steps):
            workload.train_step(next(stream))
        # One untimed save: file creation, layout and staging pool happen once per run.
        warm = ckpt.save(step)
        warm.wait()
        ckpt.tiers.wait_idle()
        result.memory = ckpt.staging_bytes
        result.checkpoint_bytes = ckpt.records[warm.version].nbytes
        if on_memory is not None:
            on_memory(result.memory)
        first_timed = warm.version + 1
        for i in range(repeats):
            # AB BA AB ...: neither arm always runs first (caches, clock boost, writeback).
            order = (False, True) if i % 2 == 0 else (True, False)
            for save in order:
                (result.checkpoint_step if save else result.baseline_step).append(segment(save))
            records = [
                r for v, r in ckpt.records.items() if v >= first_timed and r.status == "committed"
            ]
            result.stalls = [r.stall for r in records]
            result.durable = [r.durable for r in records]
            result.cpus = [r.cpu for r in records]
            if on_repeat is not None:
                on_repeat(i, result)
    return result


def check_schedule(interval: int, steps: int, repeats: int) -> None:
    """A measurement needs whole segments: checked when the study starts and per trial."""
    if interval < 1 or steps < interval or repeats < 1:
        raise ConfigError(
            f"need interval >= 1, steps >= interval and repeats >= 1; got interval={interval}, "
            f"steps={steps}, repeats={repeats} (tune.interval, tune.steps, tune.repeats)"
        )
