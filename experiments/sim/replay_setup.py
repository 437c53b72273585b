"""What the validation replays and predicts: configurations, traces, the policy objects.

One home for what ``validate_replay.py`` (the supervisor side and the simulator side) and
``replay_child.py`` (the training process) must agree on: a configuration names the
interval policy and the checkpoints in flight, and :func:`make_policy` builds the same
policy object for the engine in the child and for the simulator's prediction.

Configurations (``--fixed``, ``--policies``): ``fixed:EVERY:N`` (``FixedSteps(EVERY)``), ``pa:N``
(``PreemptionAware``, its default ``cycle`` schedule, the trace's compressed MTBF as its
prior), ``notice:N`` (``NoticeDriven(Daly)``, notices delivered before each kill),
``checkfreq:N`` (CheckFreq-style adaptive). Policies built from a calibration are seeded with
its stall, time to durable and step time as their cost priors (``seeded_priors``): without
it a process restored from a version written before any save had completed plans with the
library's defaults (stall 1 s, durable 10 s), which on this compressed clock is 10-250x the
real costs (docs/simulator.md, "Calibrating from the engine").
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pcframe.policies as P

POLICIES = ("fixed", "pa", "notice", "checkfreq")
# Seconds the notice-driven policy keeps free before the deadline: the compressed notice is
# seconds, not minutes, and the emergency save here is durable in ~50 ms.
NOTICE_MARGIN = 0.25


@dataclasses.dataclass(frozen=True)
class Config:
    """One replayed configuration: an interval policy and the checkpoints in flight."""

    policy: str
    in_flight: int
    every: int | None = None
    on_notice: bool = False  # wrapped in NoticeDriven ("+notice"): saves on a notice too

    @classmethod
    def parse(cls, text: str) -> Config:
        """``fixed:EVERY:N``, ``pa:N``, ``notice:N`` or ``checkfreq:N``; ``fixed`` and ``pa``
        may end with ``+notice`` (the policy inside ``NoticeDriven``)."""
        base, plus, rest = text.partition("+")
        if plus and rest == "notice" and base.split(":")[0] in ("fixed", "pa"):
            return dataclasses.replace(cls.parse(base), on_notice=True)
        parts = text.split(":")
        kind = parts[0]
        try:
            if kind == "fixed" and len(parts) == 3:
                return cls(kind, int(parts[2]), int(parts[1]))
            if kind in POLICIES[1:] and len(parts) == 2:
                return cls(kind, int(parts[1]))
        except ValueError:
            pass
        raise ValueError(
            f"configuration {text!r}: use fixed:EVERY:N, pa:N, notice:N or checkfreq:N "
            "(N: checkpoints in flight, 1 or 2; fixed and pa may end with +notice)"
        )

    @property
    def label(self) -> str:
        text = (
            f"fixed:{self.every}:{self.in_flight}"
            if self.every
            else f"{self.policy}:{self.in_flight}"
        )
        return text + ("+notice" if self.on_notice else "")

    @property
    def notices(self) -> bool:
        """Whether notices are delivered before the kills (the policy acts on them)."""
        return self.policy == "notice" or self.on_notice


@dataclasses.dataclass(frozen=True)
class TraceSetup:
    """A trace and how it is compressed: its mean gap between kills becomes ``gap`` wall
    seconds (the presets: harsher traces get shorter gaps, so the order of harshness is
    kept)."""

    path: str
    harshness: str
    gap: float
    steps: int


# Three shipped traces of different harshness (bamboo p3: bursts of kills, gaps' CV 1.15;
# pccheck: the previous validation's trace; bamboo g4dn: the calmest and most regular). The
# steps make a replay 50-100 s of wall time at ~105 ms per step and ~2.5 s per restart, 67 s
# on average (simulated over the campaign's plan; harsh: ~55 % of the wall time trains).
TRACES = {
    "harsh": TraceSetup("bamboo/p3-trace.csv", "harsh", 6.0, 330),
    "medium": TraceSetup("pccheck/gpus_trace.csv", "medium", 12.0, 440),
    "mild": TraceSetup("bamboo/g4dn-trace.csv", "mild", 24.0, 520),
}


def trace_setup(text: str) -> tuple[str, TraceSetup]:
    """``(key, setup)`` for ``--traces``: a preset's name, or ``PATH:GAP:STEPS`` for any
    trace file (a held-out trace: its mean gap becomes ``GAP`` wall seconds, the job trains
    ``STEPS`` steps; the presets' pairs keep a replay at 50-100 s). The key is the file's
    name without its suffix.

    Raises:
        ValueError: one line naming the argument and the fix.
    """
    if text in TRACES:
        return text, TRACES[text]
    parts = text.rsplit(":", 2)  # a path may hold a colon itself
    try:
        setup = TraceSetup(parts[0], "given", float(parts[1]), int(parts[2]))
    except (ValueError, IndexError):
        setup = None
    if setup is None or not (setup.gap > 0 and setup.steps > 0 and math.isfinite(setup.gap)):
        raise ValueError(
            f"--traces {text!r}: name a preset ({', '.join(sorted(TRACES))}) or give "
            "PATH:GAP:STEPS (a trace file, its mean gap in wall seconds > 0, steps > 0; "
            "e.g. my-trace.csv:12:440)"
        )
    key = Path(setup.path).stem
    if key in TRACES:
        raise ValueError(f"--traces {text!r}: its key {key!r} is a preset's name; rename the file")
    return key, setup


def compression(kills: Sequence[float], gap: float) -> float:
    """Trace seconds per wall second that make the mean gap between ``kills`` (trace
    seconds) ``gap`` wall seconds."""
    if not kills:
        raise ValueError("the trace has no preemption to replay")
    return (max(kills) / len(kills)) / gap


def seeded_priors(cal: dict[str, Any] | None) -> dict[str, float]:
    """Cost priors from a calibration (``stall``, ``durable``, ``iteration_time`` in
    seconds): what a user who measured the job gives the policy instead of the defaults."""
    if not cal:
        return {}
    stall = float(cal["stall"])
    return {
        "stall_prior": stall,
        "duration_prior": max(float(cal["durable"]), stall),
        "iteration_prior": float(cal["iteration_time"]),
    }


def make_policy(
    config: Config,
    mtbf: float,
    priors: dict[str, float] | None = None,
    source: P.NoticeSource | None = None,
    margin: float = NOTICE_MARGIN,
) -> P.IntervalPolicy:
    """The interval policy of ``config``, the same object type for the engine (``source``:
    where the child reads notices) and the simulator (``source=None``: ``ctx.notice``).

    ``mtbf``: the compressed trace's mean gap between kills (wall seconds), PA's prior and
    Daly's MTBF; ``priors``: :func:`seeded_priors` (``None``: the library's defaults);
    ``margin``: the seconds ``NoticeDriven`` keeps free before a notice's deadline.
    """
    kw = dict(priors or {})
    if config.on_notice:  # the plain policy inside NoticeDriven, as notice:N wraps Daly
        inner = make_policy(dataclasses.replace(config, on_notice=False), mtbf, priors)
        return P.NoticeDriven(
            inner, source, margin=margin, save_time_prior=kw.get("duration_prior", 30.0)
        )
    if config.policy == "fixed":
        return P.FixedSteps(config.every)
    if config.policy == "pa":
        return P.PreemptionAware(mtbf_prior=mtbf, **kw)
    if config.policy == "notice":
        return P.NoticeDriven(
            P.Daly(mtbf=mtbf, **kw),
            source,
            margin=margin,
            save_time_prior=kw.get("duration_prior", 30.0),
        )
    if config.policy == "checkfreq":
        return P.CheckFreq(**kw)
    raise ValueError(f"unknown policy {config.policy!r}: use one of {', '.join(POLICIES)}")


# --- the command line shared by the replays ------------------------------------------------


def settle_args(args: Any, sizes: dict[str, dict[str, Any]]) -> None:
    """Fill what ``--size`` presets and the command line left unset, then raise this
    process's priority to ``args.nice`` (the training children inherit it)."""
    for key, value in sizes[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, args.nice)
        except PermissionError:
            print("could not raise the priority: measuring at normal priority")


# --- the calibration's robust summary -------------------------------------------------------


def robust(samples: Sequence[float]) -> dict[str, float]:
    """Median, spread (1.4826 x the median absolute deviation: a standard deviation that a
    sample or two taken under a load spike cannot inflate), min, max and count."""
    xs = [float(x) for x in samples if x == x]
    if not xs:
        return {"median": math.nan, "spread": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    med = statistics.median(xs)
    mad = statistics.median(abs(x - med) for x in xs)
    return {"median": med, "spread": 1.4826 * mad, "min": min(xs), "max": max(xs), "n": len(xs)}


def _pressure(resource: str, field: str) -> float:
    """One field of the ``some`` line of ``/proc/pressure/<resource>`` (Linux pressure stall
    information); NaN where the kernel has none."""
    try:
        with open(f"/proc/pressure/{resource}") as f:
            first = f.readline().split()
        return float(dict(x.split("=") for x in first[1:])[field])
    except (OSError, KeyError, ValueError, IndexError):
        return math.nan


def pressure_total(resource: str = "cpu") -> float:
    """Microseconds some task of this machine waited for ``resource`` (``cpu``, or ``io``:
    blocked on I/O) since boot; NaN where the kernel has none."""
    return _pressure(resource, "total")


def cpu_pressure_now() -> float:
    """The share of the last 10 s in which some task of this machine waited for a CPU
    (``some avg10``, as a fraction); NaN where the kernel has none."""
    return _pressure("cpu", "avg10") / 100.0


def cpu_ticks() -> tuple[float, float]:
    """(stolen, total) CPU time of every CPU since boot, in clock ticks (``/proc/stat``):
    stolen is the time the hypervisor ran another VM on this one's CPUs, a slowdown that
    neither the load average nor the pressure figures see. NaNs where there is no such file."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:9]]
        return fields[7], sum(fields)
    except (OSError, ValueError, IndexError):
        return math.nan, math.nan


def wait_until_quiet(
    max_wait: float,
    load_below: float = 0.3,
    pressure_below: float = 0.02,
    poll: float = 5.0,
    read_load: Callable[[], float] = lambda: os.getloadavg()[0],
    read_pressure: Callable[[], float] = cpu_pressure_now,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Wait, at most ``max_wait`` s, until the machine is quiet before a calibration: the
    1-minute load average below ``load_below`` and the share of the last 10 s in which some
    task waited for a CPU below ``pressure_below``. A calibration taken while a finished
    job's load still decays measures a slower machine than the replays meet (the 12-07
    campaign began 2 min after a test run: load 2.27 falling to 0.60 during it). What it
    found is returned for the results file; a machine that never settles is measured anyway,
    and says so."""
    began = clock()
    first = read_load()
    while True:
        load, pressure = read_load(), read_pressure()
        # A kernel without pressure figures (NaN) leaves the load average to decide.
        quiet = load < load_below and not pressure >= pressure_below
        waited = clock() - began
        if quiet or waited >= max_wait:
            return {
                "waited_s": waited,
                "quiet": quiet,
                "load_at_first": first,
                "load_at_start": load,
                "pressure_at_start": pressure,
            }
        sleep(min(poll, max_wait - waited))


class LoadProbe:
    """The machine's load around a measurement: the 1-minute load average before and after,
    the share of the wall time in which some task waited for a CPU (``cpu_pressure``, from
    ``/proc/pressure/cpu`` over exactly this interval: unlike the load average, not an
    average over the last minute), the same for I/O (``io_pressure``: some task blocked on
    the disk; a restart reads code and a checkpoint, a save syncs), and the CPU seconds per
    wall second this process and its reaped children (the supervised training processes)
    got over it (``cpu_share``), and the share of the machine's CPU time the hypervisor gave
    to another VM (``steal``, :func:`cpu_ticks`)."""

    def __init__(self) -> None:
        self.before = os.getloadavg()[0]
        t = os.times()
        self._cpu0 = t.children_user + t.children_system + t.user + t.system
        self._wall0 = t.elapsed
        self._psi0 = pressure_total()
        self._io0 = pressure_total("io")
        self._ticks0 = cpu_ticks()
        self.after = math.nan
        self.cpu_share = math.nan
        self.cpu_pressure = math.nan
        self.io_pressure = math.nan
        self.steal = math.nan

    def stop(self) -> dict[str, float]:
        self.after = os.getloadavg()[0]
        t = os.times()
        cpu = t.children_user + t.children_system + t.user + t.system - self._cpu0
        wall = t.elapsed - self._wall0
        self.cpu_share = cpu / wall if wall > 0 else math.nan
        if wall > 0:
            self.cpu_pressure = (pressure_total() - self._psi0) / 1e6 / wall
            self.io_pressure = (pressure_total("io") - self._io0) / 1e6 / wall
        stolen, total = (b - a for a, b in zip(self._ticks0, cpu_ticks(), strict=True))
        self.steal = stolen / total if total > 0 else math.nan
        return self.summary()

    def summary(self) -> dict[str, float]:
        return {
            "load_before": self.before,
            "load_after": self.after,
            "load": (self.before + self.after) / 2.0,
            "cpu_share": self.cpu_share,
            "cpu_pressure": self.cpu_pressure,
            "io_pressure": self.io_pressure,
            "steal": self.steal,
        }
