"""What the simulator is told about the job and about how to run: two validated dataclasses.

``JobSpec`` holds the numbers that describe one training job on one kind of VM (iteration
time, checkpoint stall and time to durable, restart cost, ...): measured by the engine (see
:mod:`pcframe.sim.calibrate`) or taken from config. ``SimOptions`` holds how to simulate.
Both validate eagerly, so an impossible value fails before a 45-day trace is replayed, with
the key and the fix in the message.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Literal

from pcframe.errors import SimConfigError
from pcframe.runtime.checks import finite_number, whole_number

Persist = Literal["parallel", "serial"]
PolicyState = Literal["checkpoint", "process"]
ContextRate = Literal["none", "trace"]


def _bad(prefix: str, key: str, value: Any, fix: str) -> SimConfigError:
    return SimConfigError(f"{prefix}.{key}={value!r} is invalid: {fix}")


# The shortest step the simulator takes (a microsecond): shorter, a trace's steps overflow
# the int64 step counters and step times fall below the float resolution of the clock.
MIN_STEP_SECONDS = 1e-6


def _plain_numbers(spec: Any) -> None:
    """Numpy's scalars (a value read from an array) as Python's, before they are checked:
    the checks and everything downstream (JSON, the kernels) then see one kind of number."""
    for f in fields(spec):
        value = getattr(spec, f.name)
        if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
            object.__setattr__(spec, f.name, value.item())


@dataclass(frozen=True)
class JobSpec:
    """One training job. Times in seconds; prices are in :class:`SimOptions` or the trace.

    Attributes:
        iteration_time: seconds per training step on one VM.
        save_stall: seconds the training thread is blocked per checkpoint (snapshot copy,
            optimizer gating); the ``C`` of Young and Daly for asynchronous saves.
        save_duration: seconds from the start of a save until it is durable (committed);
            includes the stall, so it is at least ``save_stall``.
        max_in_flight: checkpoints that may be persisting at once (PCcheck's N). A save
            requested while N are in flight waits for the oldest (backpressure, a stall).
        persist: ``parallel``: each save is durable ``save_duration`` after it started, however
            many overlap (the storage is not the bottleneck); ``serial``: saves persist one
            after the other (a shared, saturated disk).
        restart_cost: seconds from getting VMs to training again (boot, start, restore). Paid
            at every start, including the first one and every spot/on-demand changeover.
        notice_window: seconds of warning before a spot preemption (AWS 120, GCP 30, 0 none).
            A policy sees it as ``ctx.notice``; only notice-aware policies act on it.
        checkpoint_bytes: size of one checkpoint (reported to policies in ``SaveCompleted``).
        total_steps: steps the job needs; ``None``: open-ended (train until the trace ends).
        deadline: seconds after the start by which the job must be done (needs ``total_steps``).
        vms: VMs the job asks for under the default resource policy (spot only); ``None``
            asks for the trace's whole capacity (a data-parallel job on every VM of a count
            trace; 1 on availability traces).
        min_vms: the job cannot run on fewer VMs than this (it waits for capacity).
        scaling_efficiency: fraction of linear speedup kept per doubling of VMs (data
            parallel): ``n`` VMs run ``n * scaling_efficiency ** log2(n)`` times faster.
        final_save: the job is done only when its last step is durable (a blocking save).
        survivor_tier_duration: seconds to make the newest state durable on the fastest tier
            that survives the loss of the VM (a persistent disk, a peer in another zone),
            where a notice's emergency save goes (``save(emergency=True)``); the policy sees
            it as ``ctx.tier_write_times["survivor"]``. ``None``: only the checkpoint tier
            (``save_duration``) exists.
        restart_jitter: standard deviation (seconds) of each start's restart time around
            ``restart_cost`` (normal, floored at 0); 0: every restart takes exactly that.
        iteration_jitter: relative standard deviation of each process's step time (one
            draw per process: the load of the machine it got); 0: exactly the step time.
        restart_by_tier: seconds from getting VMs to training again when the restore reads
            from a tier, per tier name of the placement policy (e.g. ``{"local": 300,
            "peers": 420, "remote": 900}``), replacing ``restart_cost`` for such restarts
            (the first start, and a tier not listed, still cost ``restart_cost``). Needs a
            placement policy (``simulate(..., placement=...)``), which also decides which
            versions survive a preemption (:mod:`pcframe.sim.tiers`). ``None`` (or empty):
            one restart cost for every restart.
        measured_starts: ``(restart seconds, step-time factor)`` of each start in order, as
            measured in a real run that the simulation replays (start ``i`` takes the ``i``-th
            pair in place of ``restart_cost``, ``restart_by_tier`` and the jitter draws; its
            steps take ``iteration_time`` x the factor; later starts are drawn as usual).
            What ``experiments/sim/validate_replay.py`` feeds its exact check of the event
            model. ``None``: every start drawn.
    """

    # Where error messages say the keys live; from_dict can name another place.
    KEY_PREFIX: ClassVar[str] = "job"
    iteration_time: float = 1.0
    save_stall: float = 2.0
    save_duration: float = 30.0
    max_in_flight: int = 2
    persist: Persist = "parallel"
    restart_cost: float = 300.0
    notice_window: float = 0.0
    checkpoint_bytes: int = 0
    total_steps: int | None = None
    deadline: float | None = None
    vms: int | None = 1
    min_vms: int = 1
    scaling_efficiency: float = 1.0
    final_save: bool = True
    survivor_tier_duration: float | None = None
    restart_jitter: float = 0.0
    iteration_jitter: float = 0.0
    restart_by_tier: dict[str, float] | None = None
    measured_starts: tuple[tuple[float, float], ...] | None = None

    def __post_init__(self) -> None:
        _plain_numbers(self)
        p = self.KEY_PREFIX
        if not (finite_number(self.iteration_time) and self.iteration_time >= MIN_STEP_SECONDS):
            raise _bad(
                p,
                "iteration_time",
                self.iteration_time,
                f"give seconds per step >= {MIN_STEP_SECONDS:g}",
            )
        for key in (
            "save_stall",
            "save_duration",
            "restart_cost",
            "notice_window",
            "restart_jitter",
        ):
            value = getattr(self, key)
            if not (finite_number(value) and value >= 0):
                raise _bad(p, key, value, "give a finite number of seconds >= 0")
        if self.save_duration < self.save_stall:
            raise _bad(
                p,
                "save_duration",
                self.save_duration,
                f"the time to durable includes the stall, so it must be >= job.save_stall="
                f"{self.save_stall}",
            )
        if not (whole_number(self.max_in_flight) and 1 <= self.max_in_flight <= 64):
            raise _bad(p, "max_in_flight", self.max_in_flight, "use 1..64 (2-4 is typical)")
        if self.persist not in ("parallel", "serial"):
            raise _bad(p, "persist", self.persist, "use 'parallel' or 'serial'")
        if not (whole_number(self.checkpoint_bytes) and self.checkpoint_bytes >= 0):
            raise _bad(p, "checkpoint_bytes", self.checkpoint_bytes, "give bytes >= 0")
        if self.total_steps is not None and not (
            whole_number(self.total_steps) and self.total_steps >= 1
        ):
            raise _bad(p, "total_steps", self.total_steps, "give steps >= 1, or null")
        if self.deadline is not None:
            if not (finite_number(self.deadline) and self.deadline > 0):
                raise _bad(p, "deadline", self.deadline, "give seconds > 0, or null")
            if self.total_steps is None:
                raise _bad(p, "deadline", self.deadline, "a deadline needs job.total_steps")
        if self.vms is not None and not (whole_number(self.vms) and self.vms >= 1):
            raise _bad(p, "vms", self.vms, "ask for at least 1 VM, or null for the trace's")
        if not (whole_number(self.min_vms) and self.min_vms >= 1):
            raise _bad(p, "min_vms", self.min_vms, "use at least 1")
        if not isinstance(self.final_save, bool):
            raise _bad(p, "final_save", self.final_save, "give true or false")
        if self.survivor_tier_duration is not None and not (
            finite_number(self.survivor_tier_duration) and self.survivor_tier_duration > 0
        ):
            raise _bad(
                p,
                "survivor_tier_duration",
                self.survivor_tier_duration,
                "give seconds > 0 to durable on the tier that survives the VM, or null",
            )
        if not (finite_number(self.iteration_jitter) and 0 <= self.iteration_jitter < 1):
            raise _bad(p, "iteration_jitter", self.iteration_jitter, "use [0, 1), e.g. 0.01")
        if not (finite_number(self.scaling_efficiency) and 0 < self.scaling_efficiency <= 1):
            raise _bad(p, "scaling_efficiency", self.scaling_efficiency, "use (0, 1]")
        self._check_restart_by_tier()
        self._check_measured_starts()

    def _check_measured_starts(self) -> None:
        p, starts = self.KEY_PREFIX, self.measured_starts
        if starts is None:
            return
        if type(starts).__module__ == "numpy" and hasattr(starts, "tolist"):
            starts = starts.tolist()  # an array of [restart, factor] rows
        pairs = []
        for i, pair in enumerate(starts if isinstance(starts, Sequence) else [starts]):
            if not (isinstance(pair, Sequence) and len(pair) == 2):
                raise _bad(p, "measured_starts", starts, "give [[restart s, step factor], ...]")
            restart, factor = pair
            if not (
                finite_number(restart)
                and restart >= 0
                and finite_number(factor)
                and factor * self.iteration_time >= MIN_STEP_SECONDS
            ):
                raise _bad(
                    p,
                    f"measured_starts[{i}]",
                    list(pair),
                    "give [restart seconds >= 0, step-time factor > 0] (steps of "
                    f">= {MIN_STEP_SECONDS:g} s)",
                )
            pairs.append((float(restart), float(factor)))
        # Tuples of floats whatever sequence came in (a Hydra ListConfig, lists, ints).
        object.__setattr__(self, "measured_starts", tuple(pairs))

    def _check_restart_by_tier(self) -> None:
        p, tiers = self.KEY_PREFIX, self.restart_by_tier
        if tiers is None:
            return
        if isinstance(tiers, Mapping) and not tiers:  # empty: not given (Hydra's default)
            object.__setattr__(self, "restart_by_tier", None)
            return
        if not isinstance(tiers, Mapping):
            raise _bad(
                p, "restart_by_tier", tiers, "give {tier: seconds}, e.g. {peers: 420}, or null"
            )
        for name, seconds in tiers.items():
            if not (isinstance(name, str) and name):
                raise _bad(p, "restart_by_tier", dict(tiers), "tier names are non-empty strings")
            if not (finite_number(seconds) and seconds >= 0):
                raise _bad(
                    p, f"restart_by_tier.{name}", seconds, "give a finite number of seconds >= 0"
                )
        # A plain dict of floats whatever mapping came in (a Hydra DictConfig, ints).
        object.__setattr__(self, "restart_by_tier", {k: float(v) for k, v in tiers.items()})

    def speedup(self, vms: int) -> float:
        """Throughput of ``vms`` VMs relative to one (data-parallel scaling)."""
        if vms < 1:
            return 0.0
        return vms * self.scaling_efficiency ** math.log2(vms)

    def step_time(self, vms: int) -> float:
        """Seconds per step on ``vms`` VMs."""
        return self.iteration_time / self.speedup(vms)

    @property
    def work_seconds(self) -> float | None:
        """Compute the job needs on one VM, in seconds (``None`` if open-ended)."""
        return None if self.total_steps is None else self.total_steps * self.iteration_time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], prefix: str = KEY_PREFIX) -> JobSpec:
        return _from_dict(cls, values, prefix)


@dataclass(frozen=True)
class SimOptions:
    """How to simulate (not what): window of the trace, seed, fidelity knobs, price fallbacks.

    Attributes:
        start: trace seconds at which the job starts.
        duration: seconds to simulate at most (``None``: until the trace ends).
        seed: draws which VMs of a multi-VM trace are lost at a drop (see docs/simulator.md).
        probe_gap: the interval policy is asked at least this often (seconds of training)
            even when its :meth:`save_hint` points later: predictions that drift with time
            (hazard by hour of day) are then picked up within ``probe_gap``.
        resource_interval: the resource policy is asked at least this often (seconds), and
            also whenever spot capacity changes or the job is preempted.
        use_hints: ``False`` asks the interval policy at every step (slow; the reference the
            fast paths are tested against).
        fast_forward: skip the ``decide`` calls of a policy whose saves are evenly spaced,
            checking that it agrees at the end of each stretch (see
            :mod:`pcframe.sim.process`); ``False`` asks at every candidate point.
        record_saves: keep the step of every save started, in order
            (``SimResult.save_steps``): what tests and ``experiments/sim/path_agreement.py``
            compare between the paths. Off by default: a sweep keeps many results.
        policy_state: ``checkpoint`` (as the engine does): a restarted process gets the policy
            state stored in the checkpoint it restored, then ``Restarted``; a preemption is
            never observed by the dying process. ``process``: one policy object lives through
            the whole job and sees ``Preempted`` and ``Restarted`` (a supervisor-held policy).
        context_rate: ``trace`` puts the trace's mean preemption rate into
            ``ctx.preemption_rate`` (hindsight knowledge for Young/Daly); ``none`` as the engine.
        spot_price, on_demand_price: $/h per VM for traces that carry no prices; ``None``
            leaves the cost of such traces unknown (NaN).
        override_prices: use the two prices above even where the trace has its own.
    """

    KEY_PREFIX: ClassVar[str] = "sim"
    start: float = 0.0
    duration: float | None = None
    seed: int = 0
    probe_gap: float = 3600.0
    resource_interval: float = 1800.0
    use_hints: bool = True
    fast_forward: bool = True
    record_saves: bool = False
    policy_state: PolicyState = "checkpoint"
    context_rate: ContextRate = "none"
    spot_price: float | None = None
    on_demand_price: float | None = None
    override_prices: bool = False

    def __post_init__(self) -> None:
        _plain_numbers(self)
        p = self.KEY_PREFIX
        if not (finite_number(self.start) and self.start >= 0):
            raise _bad(p, "start", self.start, "give trace seconds >= 0")
        if self.duration is not None and not (finite_number(self.duration) and self.duration > 0):
            raise _bad(p, "duration", self.duration, "give seconds > 0, or null for all")
        if not isinstance(self.record_saves, bool):
            raise _bad(p, "record_saves", self.record_saves, "give true or false")
        if not (whole_number(self.seed) and self.seed >= 0):
            raise _bad(p, "seed", self.seed, "give an integer >= 0")
        for key in ("probe_gap", "resource_interval"):
            value = getattr(self, key)
            if not (finite_number(value) and value > 0):
                raise _bad(p, key, value, "give seconds > 0")
        if self.policy_state not in ("checkpoint", "process"):
            raise _bad(p, "policy_state", self.policy_state, "use 'checkpoint' or 'process'")
        if self.context_rate not in ("none", "trace"):
            raise _bad(p, "context_rate", self.context_rate, "use 'none' or 'trace'")
        for key in ("spot_price", "on_demand_price"):
            value = getattr(self, key)
            if value is not None and not (finite_number(value) and value >= 0):
                raise _bad(p, key, value, "give $/h per VM >= 0, or null")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], prefix: str = KEY_PREFIX) -> SimOptions:
        return _from_dict(cls, values, prefix)


def _from_dict(cls: type, values: dict[str, Any], prefix: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SimConfigError(
            f"{prefix}: unknown key(s) {unknown}; known keys: {', '.join(sorted(known))}"
        )
    try:
        return cls(**values)
    except SimConfigError as exc:
        # __post_init__ names keys under the class's own prefix ("job.", "sim."); here the
        # caller knows where they really live (e.g. "sim.job." in pcframe-sim's config).
        own = cls.KEY_PREFIX
        if prefix == own:
            raise
        raise SimConfigError(re.sub(rf"(?<![\w.]){own}\.", f"{prefix}.", str(exc))) from None
