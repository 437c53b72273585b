"""Validation against reality: replay traces' preemptions on a compressed clock with the real
engine and the real interval policies, and compare the measured goodput with the
simulator's prediction made from a calibration measured **before** the replays.

1. Calibrate once, before any replay, on the same workload (``calibrate``): the bare step
   time (in-process runs), what each save costs the training loop (its steps' extra time,
   the save and the steps after it: the engine's own stall figure leaves out the calls
   around it) and the time to durable per save at each number in flight (in-process runs),
   and the restart cost and the step time of the loop as the
   replay runs it from a supervised child SIGKILLed ``--restarts`` times (from each kill to
   its successor's first step: process start, imports, restore, that step). Each input is
   the **median** of its samples, its spread 1.4826 x their median absolute deviation
   (``replay_setup.robust``); the machine's load (1-minute load average before and after,
   the share of the time some task waited for a CPU from ``/proc/pressure/cpu``, the CPU
   seconds per wall second this process and its children got) is recorded with it.
2. Replay: ``pcframe.apps.preemption.Supervisor`` runs the training child
   (``replay_child.py``: the real engine asking the real policy at every step, a real
   model, each step with an accelerator-like sleep), SIGKILLs it at the trace's
   preemption times (compressed so that the mean gap is the trace's ``gap``, shifted
   earlier by each offset) and restarts it at once, until the trace's steps are trained.
   For ``notice:N`` a notice file is written ``--notice-lead`` s before each kill (the
   child's ``FileNoticeSource``) and removed at the kill. The load is recorded again.
   A trace's configurations take turns (``interleaved``): the machine drifts over a
   campaign, and one configuration run after another would take its stretch of the drift
   for an effect of its policy.
3. Predict each replay twice with ``pcframe.simulate`` on the same kill times, the same
   policy built by ``replay_setup.make_policy`` and the simulator's every-step path (what
   the engine does): the **headline** from the calibration's inputs only (what a user has
   when choosing a policy), and the model check from the inputs measured in the replay
   itself (its restarts, and the calibrated step time scaled by how its compute per step
   moved: the child's ``pace`` events). Each is the mean over ``--draws`` seeds of
   restart and step times drawn with the measured spread. The difference of the two is
   what moved between calibration and replay (the machine's load), shown beside the load.
   A replay ends at the child's ``done`` line (last step durable, engine closed), as the
   simulated job does, not when the interpreter has exited.
4. Score goodput twice. Over the whole run (steps / wall): a short replay's end races its
   last kills, so a prediction 1 % slower catches one more kill than the real run (a whole
   restart more: 4-8 % of a 60 s replay) and the error is mostly which side of a kill the
   end fell on. And, the **headline**, over a window fixed before the replay: the steps the
   job holds ``WINDOW`` x the shortest predicted wall into the run (the newest step reached
   by then, or the step it resumed from if a kill came after that step), in the replay and
   in the simulator alike (its trace ends there and the steps done count). Every kill in
   the window falls on both; none after it counts on either (the end is moved before any
   kill within ``KILL_MARGIN`` of it, where a kill could fall on either side).
5. Say how finely each replay can check: its own noise (``noise_window_pct``), the spread
   of the prediction's seeds relative to their mean, is known before it runs; where two
   standard deviations of it exceed the 5 % tolerance, a replay cannot tell a 5 % error
   from phase luck. So the campaign sizes itself before each configuration runs
   (``replay_sizing``): more shifted replays, up to ``--max-replays``, until the noise of
   their mean fits; where even that many cannot, the verdict says how many would. Errors
   beyond twice the noise are the inputs' or the model's; the root mean square of the
   errors in units of the noise checks the noise model itself (1 if it is right).

    python experiments/sim/validate_replay.py --size campaign   # ~50 min here
    python experiments/sim/validate_replay.py --size quick      # smoke, ~4 min
    # any trace file: PATH:GAP:STEPS (its mean gap becomes GAP wall seconds, STEPS steps)
    python experiments/sim/validate_replay.py --traces harsh my-trace.csv:12:440
    # every fixed interval at every shift, calibrated again before each trace (~55 min):
    python experiments/sim/validate_replay.py --size campaign --policies --fixed-offsets all \
        --calibrate per-trace --out experiments/results/sim_validation_fixed
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import RESULTS, csv_header, header, write_results
from replay_child import accelerated
from replay_setup import (
    NOTICE_MARGIN,
    TRACES,
    Config,
    LoadProbe,
    compression,
    make_policy,
    robust,
    seeded_priors,
    settle_args,
    trace_setup,
    wait_until_quiet,
)
from replay_sizing import (
    SIGMAS,
    TOLERANCE,
    Forecast,
    Sizing,
    candidate_offsets,
    mean_noise_pct,
    replays_needed,
    size,
)

import pcframe.policies as P
from pcframe.apps.preemption import ChildSpec, Supervisor, resolve_trace, trace_times
from pcframe.apps.training import EVENT_PREFIX, train
from pcframe.apps.workloads import build
from pcframe.config import EngineConfig
from pcframe.policies.traces import Trace
from pcframe.sim import JobSpec, SimOptions, loop_save_costs, simulate
from pcframe.sim.report import markdown_table, write_csv

# Seconds per tick of the replayed trace given to the simulator. A kill lands at the start
# of the tick after it, so up to a tick late: a save whose commit lands within that tick
# survives in the simulator and not in the replay. The 12-07 campaign's medium
# `fixed:100:1` lost its first checkpoint to a kill 23 ms before the commit; on a 50 ms
# grid the simulator kept it and every later life resumed from it (exact check +24 %).
TICK = 0.01
# A window's end keeps this far from any kill: the supervisor's kill lands a few ms after
# its planned time, and the replay and the simulator must both see it on the same side.
KILL_MARGIN = 0.1
# Floors of the measured spreads: a handful of samples can agree by chance. The calibrated
# restart spread is also at least 10 % of the restart (experiment 5's jitter): a replay's
# restarts spread by 0.1-1.2 s on this machine, and a prediction drawn with less rests on
# one phase of kills vs checkpoints.
MIN_RESTART_JITTER = 0.05
MIN_ITERATION_JITTER = 0.005
WORKLOAD = {"hidden": 512, "layers": 4, "samples": 8192}  # 10 MB of state with AdamW
RESTART_GAP = 6.0
# The in-process calibration of a save's costs: steps and a save every this many (each
# save's cost is its step and the two after it: pcframe.sim.loop_save_costs).
CALIBRATION_STEPS = 240
CALIBRATION_EVERY = 5
# A life's compute per step counts from this many steps on: a shorter one is mostly its
# first step after the restore (warm-up), whose cost the restart samples already hold.
MIN_PACE_STEPS = 20  # wall seconds between the calibration's kills
# The scoring window, as a share of the shortest predicted wall of the replay (before it
# runs): far enough from every end the replay or a prediction may have that none races a
# kill inside it, long enough to hold most of the replay's kills.
WINDOW = 0.8

# Fixed intervals (steps) and the policies of the campaign; every trace gets all of them.
CAMPAIGN_FIXED = ["fixed:10:2", "fixed:25:1", "fixed:50:2", "fixed:100:1"]
CAMPAIGN_POLICIES = ["pa:2", "notice:1", "checkfreq:2"]
SIZES: dict[str, dict[str, Any]] = {
    # ~60 min here (idle machine): calibrations ~3 min before and after, 3 traces x (4
    # fixed intervals at one offset each, rotated + 3 policies x 3 offsets) = 39 replays of
    # 50-100 s, more where the sizing asks (45 on 12-07), predictions and teardown ~3 min.
    "campaign": dict(
        traces=["harsh", "medium", "mild"],
        fixed=CAMPAIGN_FIXED,
        policies=CAMPAIGN_POLICIES,
        offsets=[0.0, 1.5, 3.0],
        fixed_offsets="one",
        max_replays=6,
        calibrate="once",
        calibrate_after=True,
        settle=600.0,
        # 12 kills over ~75 s: the restart time wanders by 0.3-1 s over a minute here (the
        # 12-08 calibration's first 6 kills: 3.89 3.60 3.18 2.98 2.78 2.81 s; its replays
        # then restarted in 2.6-2.9 s), and a median of 6 took such a stretch for the mean.
        restarts=12,
        draws=24,
        steps_scale=1.0,
    ),
    # Smoke: one trace, one fixed interval and each policy once, short replays (~4 min).
    "quick": dict(
        traces=["medium"],
        fixed=["fixed:25:1"],
        policies=["pa:2", "notice:1", "checkfreq:2"],
        offsets=[0.0],
        fixed_offsets="one",
        max_replays=1,
        calibrate="once",
        calibrate_after=False,
        settle=0.0,
        restarts=3,
        draws=6,
        steps_scale=0.3,
    ),
}


@dataclasses.dataclass
class ReplayChild(ChildSpec):
    """The supervisor's child spec, running ``replay_child.py`` instead of the stock loop."""

    config: str = "fixed:50:2"
    accelerator_ms: float = 90.0
    mtbf: float = 3600.0
    priors: dict[str, float] = dataclasses.field(default_factory=dict)
    notice_file: str | None = None
    notice_lead: float = 2.0
    paced: bool = False  # accelerator_ms is the whole step (replay_child --paced)
    vms: int = 1
    scaling: float = 1.0
    stop_file: str | None = None  # a planned stop (replay_child --stop-file)
    notice_margin: float = NOTICE_MARGIN

    def command(self, python: str = sys.executable) -> list[str]:
        cmd = [
            python,
            str(Path(__file__).with_name("replay_child.py")),
            "--directory",
            self.directory,
            "--steps",
            str(self.steps),
            "--config",
            self.config,
            "--in-flight",
            str(Config.parse(self.config).in_flight),
            "--accelerator-ms",
            str(self.accelerator_ms),
            "--workload-args",
            json.dumps(self.workload_args),
            "--mtbf",
            repr(self.mtbf),
            "--priors",
            json.dumps(self.priors),
            "--notice-lead",
            repr(self.notice_lead),
            "--notice-margin",
            repr(self.notice_margin),
        ]
        if self.notice_file:
            cmd += ["--notice-file", self.notice_file]
        if self.paced:
            cmd += ["--paced", "--vms", str(self.vms), "--scaling", repr(self.scaling)]
        if self.stop_file:
            cmd += ["--stop-file", self.stop_file]
        return cmd


class NoticeWriter(threading.Thread):
    """Writes ``path`` (the seconds left) ``lead`` s before each kill and removes it at the
    kill, on a clock started with the supervisor's (``start``: its ``time.monotonic``)."""

    def __init__(self, path: Path, kills: list[float], lead: float) -> None:
        super().__init__(daemon=True)
        self.path, self.kills, self.lead = path, kills, lead
        self.stopped = threading.Event()
        self.start_time = time.monotonic()
        self.delivered = 0

    def _until(self, t: float) -> bool:
        return not self.stopped.wait(max(0.0, self.start_time + t - time.monotonic()))

    def run(self) -> None:
        for kill in self.kills:
            if kill - self.lead > 0 and self._until(kill - self.lead):
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(f"{self.lead}")
                os.replace(tmp, self.path)
                self.delivered += 1
            if not self._until(kill):
                break
            self.path.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.path.unlink(missing_ok=True)


def supervised(
    args: argparse.Namespace,
    config: Config,
    kills: list[float],
    directory: Path,
    steps: int,
    mtbf: float = 3600.0,
    priors: dict[str, float] | None = None,
    commits: list[tuple[float, int]] | None = None,
) -> tuple[Any, list[tuple[float, int]], dict[int, float], int]:
    """A supervised child killed at ``kills``: the run, its (time, step) lines, the compute
    seconds per step of each life that trained long enough, by its index in ``run.lives``
    (``pace`` events, checkpoint stalls left out) and the notices delivered; ``commits``
    gets the (time, step) of each version committed."""
    timeline: list[tuple[float, int]] = []
    paces: dict[int, tuple[int, float]] = {}
    done_at: list[float] = []
    notice = directory.with_name(directory.name + "-notice") if config.notices else None
    spec = ReplayChild(
        directory=str(directory),
        steps=steps,
        workload="mlp",
        workload_args=WORKLOAD,
        threads=1,
        config=config.label,
        accelerator_ms=args.accelerator_ms,
        mtbf=mtbf,
        priors=priors or {},
        notice_file=str(notice) if notice else None,
        notice_lead=args.notice_lead,
        paced=getattr(args, "paced", False),
    )
    # The children's stderr is kept next to their checkpoints: a child that fails says why.
    logs = directory.with_name(directory.name + "-logs")
    writer = NoticeWriter(notice, kills, args.notice_lead) if notice else None
    start = time.monotonic()

    def on_line(index: int, line: str) -> None:
        if line.startswith("step "):
            timeline.append((time.monotonic() - start, int(line.split()[1])))
        elif line.startswith(EVENT_PREFIX):
            event = json.loads(line[len(EVENT_PREFIX) :])  # well-formed, or fail loudly
            if event["event"] == "pace":
                paces[index] = (int(event["steps"]), float(event["seconds"]))
            elif event["event"] == "committed" and commits is not None:
                commits.append((time.monotonic() - start, int(event["step"])))
            elif event["event"] == "done":
                done_at.append(time.monotonic() - start)

    if writer is not None:
        writer.start_time = start
        writer.start()
    try:
        run = Supervisor(spec, kills, timeout=1800.0, on_line=on_line, log_dir=logs).run()
    finally:
        if writer is not None:
            writer.stop()
    per_life = {
        life: seconds / steps for life, (steps, seconds) in paces.items() if steps >= MIN_PACE_STEPS
    }
    if done_at:
        # The job ends when its last step is durable and the engine closed (the ``done``
        # line), as in the simulator, not when the interpreter has torn torch down (~0.5-1 s
        # later: 1-2 % of a 60 s replay, 3-7 % of a smoke run's).
        run.wall = done_at[-1]
    return run, timeline, per_life, writer.delivered if writer else 0


# --- 1. calibration, before any replay ------------------------------------------------------


def calibrate(args: argparse.Namespace, in_flights: list[int], root: Path) -> dict[str, Any]:
    """What the simulator needs, measured on this workload before the replays: medians,
    spreads and the load they were measured under. First it waits for a quiet machine, at
    most ``args.settle`` seconds."""
    settle = getattr(args, "settle", None) or 0.0
    settled = wait_until_quiet(settle) if settle > 0 else None
    probe = LoadProbe()
    paced = getattr(args, "paced", False)
    bare = [
        train(accelerated(build("mlp", **WORKLOAD), args.accelerator_ms, paced), 100)[0]
        for _ in range(3)
    ]
    bare_steps = [r.seconds / r.steps for r in bare]
    costs: dict[int, dict[str, Any]] = {}
    for n in sorted(set(in_flights)):
        directory = root / f"calibrate-{n}"
        ends: list[float] = []
        _, ckpt = train(
            accelerated(build("mlp", **WORKLOAD), args.accelerator_ms, paced),
            CALIBRATION_STEPS,
            directory,
            P.FixedSteps(CALIBRATION_EVERY),
            EngineConfig(max_in_flight=n),
            lambda step, ends=ends: ends.append(time.perf_counter()),
        )
        done = [r for r in ckpt.records.values() if r.status == "committed"]
        shutil.rmtree(directory, ignore_errors=True)
        costs[n] = {
            "stall": robust(
                loop_save_costs(ends, range(CALIBRATION_EVERY, len(ends) + 1, CALIBRATION_EVERY))
            ),
            "engine_stall": robust([r.stall for r in done]),
            "durable": robust([r.durable for r in done]),
        }
    # The restart cost and the step time of the loop as the replay runs it: a supervised
    # child (the engine in the loop, printing each step) SIGKILLed args.restarts times.
    kills = [RESTART_GAP * (i + 1) for i in range(args.restarts)]
    it0 = statistics.median(bare_steps)
    steps = int((args.restarts * (RESTART_GAP - 2.0) + 8.0) / it0)
    run, timeline, paces, _ = supervised(
        args, Config("fixed", 1, 25), kills, root / "restart", steps
    )
    shutil.rmtree(root / "restart", ignore_errors=True)
    lives = life_step_times(timeline)
    step = robust(lives or bare_steps)
    restart = robust(run.whole_restarts)
    load = probe.stop()
    it = step["median"]
    return {
        "iteration_time": it,
        "iteration_bare": statistics.median(bare_steps),
        "iteration_jitter": max(step["spread"] / it, MIN_ITERATION_JITTER),
        "step": step,
        # A sample ends with the first step trained; the simulator adds that step itself.
        "restart": max(restart["median"] - it, 0.0),
        "restart_jitter": max(restart["spread"], MIN_RESTART_JITTER, 0.1 * restart["median"]),
        "restart_stats": restart,
        "restart_samples": run.whole_restarts,
        "compute": statistics.median(paces.values()) if paces else math.nan,
        "costs": costs,
        "settle": settled,
        **load,
    }


def life_step_times(timeline: list[tuple[float, int]], min_steps: int = 20) -> list[float]:
    """Mean step time of each life of a supervised run (a life: steps counting up)."""
    out, life = [], []
    for t, step in timeline:
        if life and step <= life[-1][1]:
            out.append(life)
            life = []
        life.append((t, step))
    out.append(life)
    return [
        (life[-1][0] - life[0][0]) / (life[-1][1] - life[0][1])
        for life in out
        if len(life) > min_steps
    ]


def inputs(cal: dict[str, Any], n: int) -> dict[str, float]:
    """The simulator's inputs at ``n`` in flight from a calibration (or replay) summary."""
    c = cal["costs"][n]
    stall = c["stall"]["median"]
    return {
        "iteration_time": cal["iteration_time"],
        "iteration_jitter": cal["iteration_jitter"],
        "restart": cal["restart"],
        "restart_jitter": cal["restart_jitter"],
        "stall": stall,
        "durable": max(c["durable"]["median"], stall),
    }


def measured_inputs(cal: dict[str, Any], run: Any, paces: list[float]) -> dict[str, Any]:
    """The calibration with restart (mean, deviation) as measured in ``run`` and the step
    time scaled by how the compute per step moved (``paces``: each life's, stalls left out;
    the time between two step lines holds the stalls, which the simulator adds itself)."""
    it = cal["iteration_time"]
    if paces and cal["compute"] == cal["compute"]:
        # The spread stays the calibration's: a few lives' paces would give a spread that
        # the convexity of goodput in the step time turns into a bias.
        it *= statistics.median(paces) / cal["compute"]
    # This replay's own restarts: all of them count (its mean), none is an estimate.
    samples = run.whole_restarts or cal["restart_samples"]
    spread = statistics.stdev(samples) if len(samples) > 1 else 0.0
    return dict(
        cal,
        iteration_time=it,
        restart=max(statistics.fmean(samples) - it, 0.0),
        restart_jitter=max(spread, MIN_RESTART_JITTER),
    )


# --- 3. prediction -----------------------------------------------------------------------------


def kill_trace(kills: list[float], horizon: float) -> Trace:
    """The kill times as a pcframe trace: up, except one ``TICK`` at each kill."""
    up = np.ones(int(horizon / TICK), dtype=np.int64)
    for k in kills:
        tick = math.ceil(k / TICK)
        if tick < up.size:
            up[tick] = 0
    return Trace("replayed-kills", "replay", TICK, 1, up)


def exact_starts(
    run: Any, kills: list[float], paces: dict[int, float], step_time: float
) -> tuple[tuple[float, float], ...]:
    """Each life of ``run`` as the simulator's start of the same index: ``(restart, step
    factor)`` such that the simulated process, started when :func:`kill_trace` lets it
    (the tick after its kill's tick), ends its first step when the real one did, and then
    steps at the life's own pace (``paces``, relative to their median; 1 for a life too
    short to have one). A life killed before its first step gets a restart that outlasts
    its kill. Fed to the simulator, nothing is drawn: what is left of the error is the
    event model's (and the kill ticks' ``TICK`` grid).
    """
    typical = statistics.median(paces.values()) if paces else 0.0
    out = []
    begin = 0.0  # the job clock starts with the first process
    for i, life in enumerate(run.lives):
        factor = paces[i] / typical if typical and i in paces else 1.0
        if life.first_step_at is not None:
            restart = life.first_step_at - begin - step_time * factor
        else:  # never trained: up past its kill
            restart = life.ended - begin + 1.0
        out.append((max(restart, 0.0), factor))
        if life.killed:
            kill = min(kills, key=lambda k: abs(k - life.ended)) if kills else life.ended
            begin = (math.ceil(kill / TICK) + 1) * TICK  # kill_trace: down for that tick
    return tuple(out)


def job_for(x: dict[str, float], config: Config, steps: int, lead: float) -> JobSpec:
    # The outage tick is part of the measured restart time: take it out of the cost.
    return JobSpec(
        iteration_time=x["iteration_time"],
        save_stall=x["stall"],
        save_duration=x["durable"],
        restart_cost=max(x["restart"] - TICK, 0.0),
        max_in_flight=config.in_flight,
        total_steps=steps,
        final_save=True,
        notice_window=lead if config.notices else 0.0,
        restart_jitter=x["restart_jitter"],
        iteration_jitter=x["iteration_jitter"],
    )


def predict(
    x: dict[str, float],
    config: Config,
    kills: list[float],
    steps: int,
    draws: int,
    mtbf: float,
    lead: float,
    priors: dict[str, float] | None,
    window: float | None = None,
    starts: tuple[tuple[float, float], ...] | None = None,
) -> list[Any]:
    """The simulator's runs over ``draws`` seeds: ``config``'s policy (a fresh object per
    run, built as the child builds it) asked at every step, as the engine asks it.
    ``window``: the trace ends there (the job's steps done by then count as useful).
    ``starts``: each start's measured costs (``JobSpec.measured_starts``)."""
    job = dataclasses.replace(job_for(x, config, steps, lead), measured_starts=starts)
    horizon = window if window is not None else 4.0 * steps * job.iteration_time + 600.0
    trace = kill_trace(kills, horizon)
    return [
        simulate(
            trace,
            make_policy(config, mtbf, priors),
            job,
            options=SimOptions(seed=seed, use_hints=False),
        )
        for seed in range(draws)
    ]


# --- the campaign -------------------------------------------------------------------------------


def plan(args: argparse.Namespace) -> list[tuple[str, Config, float]]:
    """(trace key, configuration, offset in gaps) of every replay, in run order."""
    out = []
    for i, key in enumerate(args.traces):
        for text in args.fixed:
            if args.fixed_offsets == "all":  # shifted like the policies: a mean per interval
                out += [(key, Config.parse(text), o) for o in args.offsets]
                continue
            # One offset per fixed interval, rotated over the traces and intervals.
            j = (i + len(out)) % len(args.offsets)
            out.append((key, Config.parse(text), args.offsets[j]))
        for text in args.policies:
            out += [(key, Config.parse(text), o) for o in args.offsets]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="campaign")
    parser.add_argument(
        "--traces",
        nargs="+",
        help=f"trace presets ({', '.join(sorted(TRACES))}) or PATH:GAP:STEPS for any trace file",
    )
    parser.add_argument("--fixed", nargs="*", help="fixed:EVERY:N configurations")
    parser.add_argument("--policies", nargs="*", help="pa:N, notice:N, checkfreq:N")
    parser.add_argument(
        "--offsets",
        nargs="+",
        type=float,
        help="shift the kill schedule earlier by these multiples of the trace's mean gap; "
        "each policy is replayed once per shift, each fixed interval at one of them",
    )
    parser.add_argument(
        "--fixed-offsets",
        choices=["one", "all"],
        help="replay each fixed interval at one of the offsets (rotated; the presets) or at "
        "all of them",
    )
    parser.add_argument(
        "--calibrate",
        choices=["once", "per-trace"],
        help="calibrate once before every replay (the presets) or again before each trace's "
        "replays (inputs measured closer to the runs they predict, still before them)",
    )
    parser.add_argument(
        "--max-replays",
        type=int,
        help="shifted replays a configuration may get when its own noise (predicted before "
        "it runs) needs more than its least to check the tolerance (replay_sizing)",
    )
    parser.add_argument(
        "--calibrate-after",
        action=argparse.BooleanOptionalAction,
        help="calibrate once more after the last replay: how far the machine drifted",
    )
    parser.add_argument(
        "--settle",
        type=float,
        help="wait up to this many seconds for a quiet machine before each calibration",
    )
    parser.add_argument("--restarts", type=int, help="kills of the restart calibration")
    parser.add_argument("--draws", type=int, help="seeds of each jittered prediction")
    parser.add_argument("--steps-scale", type=float, help="x the traces' steps per replay")
    parser.add_argument("--accelerator-ms", type=float, default=90.0)
    parser.add_argument(
        "--notice-lead", type=float, default=1.0, help="seconds of notice before each kill"
    )
    parser.add_argument(
        "--seeded",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="policies get the calibrated costs as priors (see replay_setup)",
    )
    parser.add_argument("--nice", type=int, default=-10)
    parser.add_argument("--out", default=str(RESULTS / "sim_validation"))
    args = parser.parse_args()
    settle_args(args, SIZES)
    if args.restarts < 3:
        parser.error("--restarts: at least 3 kills (5 or more for a robust median)")
    try:  # every trace read before the calibration: a wrong one fails in a second
        args.setups = dict(trace_setup(text) for text in args.traces)
        if len(args.setups) < len(args.traces):
            raise ValueError("--traces: two traces with one key (a file's name); rename one")
        if "after" in args.setups:
            raise ValueError("--traces: 'after' names the last calibration; rename the trace")
        for setup in args.setups.values():
            compression(trace_times(resolve_trace(setup.path)), setup.gap)
    except ValueError as exc:  # a preset's name or PATH:GAP:STEPS; a readable trace
        parser.error(str(exc))
    args.traces = list(args.setups)
    torch.set_num_threads(1)
    replays = plan(args)
    root = Path(tempfile.mkdtemp(prefix="pcframe-validate-"))  # the system temp dir
    began = time.monotonic()
    try:
        in_flight = sorted({c.in_flight for _, c, _ in replays})
        cals: dict[str, dict[str, Any]] = {}  # by the trace it was made before ("" : all)
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        raws: list[dict[str, Any]] = []  # each replay as it ran, to predict it again later
        planned = len(replays)
        sizings: dict[tuple[str, str], Sizing] = {}
        for key in args.traces:
            due = key if args.calibrate == "per-trace" else ""
            if due not in cals:
                cals[due] = calibrate(args, in_flight, root)
                print(f"calibrated at {time.monotonic() - began:.0f} s: {summary_line(cals[due])}")
            cal = cals[due]
            # Every configuration of this trace sized before any of them runs: as many
            # shifted replays as its own noise needs (replay_sizing).
            runs: list[list[Prepared]] = []
            for k, config, first in grouped(replays):
                if k != key:
                    continue
                sizing, prepared = sized(args, key, config, first, cal)
                planned += len(sizing.offsets) - len(first)
                sizings[(key, config.label)] = sizing
                runs.append(prepared)
                print(f"{key} {config.label}: {sizing.describe()}")
            for p in interleaved(runs):
                r, raw = replay(args, p, cal, root / f"replay-{len(raws)}")
                groups.setdefault((key, p.config.label), []).append(r)
                raws.append(raw)
                done = time.monotonic() - began
                print(
                    f"[{len(raws)}/{planned} {done:.0f} s] {key} {p.config.label} offset "
                    f"{p.offset:g}: window {r['window_s']:.1f} s: measured "
                    f"{r['goodput_window_measured']:.3f}, predicted "
                    f"{r['goodput_window_predicted']:.3f} ({r['error_window_pct']:+.1f} %); "
                    f"whole run {r['error_pct']:+.1f} %, in-replay check "
                    f"{r['error_in_replay_pct']:+.1f} %, exact {r['error_window_exact_pct']:+.1f} "
                    f"% (window) {r['error_exact_pct']:+.1f} %"
                )
                # Rewritten after every replay: a campaign cut short keeps what it measured.
                write_outputs(args, with_means(groups), cals, done, planned, sizings)
                write_raw(Path(args.out), raws, cals)
        if args.calibrate_after:
            cals["after"] = calibrate(args, in_flight, root)
            done = time.monotonic() - began
            print(f"calibrated again at {done:.0f} s: {summary_line(cals['after'])}")
            write_outputs(args, with_means(groups), cals, done, planned, sizings)
            write_raw(Path(args.out), raws, cals)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def grouped(replays: list[tuple[str, Config, float]]) -> list[tuple[str, Config, list[float]]]:
    """The plan's replays as (trace key, configuration, its offsets), in run order."""
    out: dict[tuple[str, str], tuple[str, Config, list[float]]] = {}
    for key, config, offset in replays:
        out.setdefault((key, config.label), (key, config, []))[2].append(offset)
    return list(out.values())


def sized(
    args: argparse.Namespace, key: str, config: Config, first: list[float], cal: dict[str, Any]
) -> tuple[Sizing, list[Prepared]]:
    """``config`` on trace ``key``: its replays as many as its own noise needs, predicted
    before any runs (:func:`replay_sizing.size`), at ``first`` and more offsets."""
    prepared: dict[float, Prepared] = {}

    def forecast_at(offset: float) -> Forecast:
        prepared[offset] = p = prepare(args, key, config, offset, cal)
        return p.forecast()

    most = max(args.max_replays, len(first))
    sizing = size(candidate_offsets(first, args.offsets, most), len(first), most, forecast_at)
    return sizing, [prepared[o] for o in sizing.offsets]


def interleaved(runs: list[list[Any]]) -> list[Any]:
    """Each configuration's replays (``runs``, one list per configuration) in rounds: every
    configuration's first, then every one's second, and so on, each round starting one
    configuration later. The machine drifts over a campaign (its restarts by ~0.3 s over
    a quarter of an hour, the same way for each trace of the 12-06 campaign); run one
    configuration after another, and a configuration's mean takes the drift of its own
    stretch of time for an effect of the policy."""
    out = []
    for i in range(max((len(r) for r in runs), default=0)):
        turn = [r[i] for r in runs if i < len(r)]
        shift = i % len(turn)
        out += turn[shift:] + turn[:shift]
    return out


@dataclasses.dataclass
class Prepared:
    """One replay as planned before it runs: its kills, steps and the policy's priors, the
    calibration's inputs, and the simulator's prediction of it (whole run and window)."""

    key: str
    config: Config
    offset: float
    compression: float
    kills: list[float]
    steps: int
    priors: dict[str, float] | None
    before: dict[str, float]
    predictor: Callable[..., list[Any]]  # predict() with this replay's plan
    sims: list[Any]
    window: float
    windowed: list[Any]  # the prediction over the window

    def forecast(self) -> Forecast:
        goodputs = [d.useful_steps / self.window for d in self.windowed]
        spread = statistics.stdev(goodputs) if len(goodputs) > 1 else 0.0
        return Forecast(self.offset, statistics.fmean(goodputs), spread)


def prepare(
    args: argparse.Namespace, key: str, config: Config, offset: float, cal: dict[str, Any]
) -> Prepared:
    """``config`` replayed on trace ``key`` shifted by ``offset`` mean gaps, predicted from
    the calibration ``cal`` alone."""
    setup = args.setups[key]
    trace_kills = trace_times(resolve_trace(setup.path))
    c = compression(trace_kills, setup.gap)
    kills = [k / c - offset * setup.gap for k in trace_kills if k / c > offset * setup.gap]
    steps = max(40, round(setup.steps * args.steps_scale))
    before = inputs(cal, config.in_flight)
    priors = seeded_priors(before) if args.seeded else None
    predictor = functools.partial(
        predict,
        config=config,
        kills=kills,
        steps=steps,
        draws=args.draws,
        mtbf=setup.gap,
        lead=args.notice_lead,
        priors=priors,
    )
    sims = predictor(before)
    # The window is fixed by the prediction alone, before the replay.
    window = clear_of_kills(WINDOW * min(d.wall_seconds for d in sims), kills)
    return Prepared(
        key, config, offset, c, kills, steps, priors, before, predictor, sims, window,
        predictor(before, window=window),
    )  # fmt: skip


def replay(
    args: argparse.Namespace, p: Prepared, cal: dict[str, Any], directory: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the prepared replay for real and score it: its row and its raw record."""
    setup = args.setups[p.key]
    probe = LoadProbe()
    committed: list[tuple[float, int]] = []
    run, timeline, paces, notices = supervised(
        args, p.config, p.kills, directory, p.steps, setup.gap, p.priors, committed
    )
    load = probe.stop()
    shutil.rmtree(directory, ignore_errors=True)
    own = inputs(measured_inputs(cal, run, list(paces.values())), p.config.in_flight)
    # The event model alone: this replay's own restarts and paces, start by start.
    starts = exact_starts(run, p.kills, paces, own["iteration_time"])
    exact = functools.partial(p.predictor, own, draws=1, starts=starts)
    scored = Windowed(
        p.window,
        held_at(run, timeline, p.window),
        sum(1 for life in run.lives if life.killed and life.ended <= p.window),
        p.windowed,
        p.predictor(own, window=p.window),
        exact(window=p.window),
    )
    r = row(
        p.key, p.config, p.offset, p.compression, p.steps, run, notices, p.before, own,
        p.sims, p.predictor(own), exact(), load, cal, scored,
    )  # fmt: skip
    raw = raw_replay(p.key, p.config, p.offset, p.kills, run, timeline, paces, committed)
    return r, raw


def raw_replay(
    key: str,
    config: Config,
    offset: float,
    kills: list[float],
    run: Any,
    timeline: list[tuple[float, int]],
    paces: dict[int, float],
    commits: list[tuple[float, int]],
) -> dict[str, Any]:
    """One replay as it ran (times in ms on the job clock): enough to predict it again with
    another model or other inputs without running it again."""

    def ms(t: float | None) -> int | None:
        return None if t is None else round(1e3 * t)

    return {
        "trace": key,
        "config": config.label,
        "offset_gaps": offset,
        "wall_ms": ms(run.wall),
        "kills_ms": [ms(k) for k in kills if k <= run.wall + 1.0],
        "lives": [
            {
                "spawned_ms": ms(life.spawned),
                "first_step_ms": ms(life.first_step_at),
                "ended_ms": ms(life.ended),
                "killed": life.killed,
                "start_step": life.start_step,
                "last_step": life.last_step,
            }
            for life in run.lives
        ],
        "pace_us": {str(i): round(1e6 * p) for i, p in paces.items()},
        "steps_ms": [[ms(t), step] for t, step in timeline],
        "commits_ms": [[ms(t), step] for t, step in commits],
    }


def write_raw(out: Path, raws: list[dict[str, Any]], cals: dict[str, dict]) -> None:
    """``<out>.raw.json``: every replay as it ran and the calibrations they were predicted
    from."""
    data = {"calibrations": cals, "replays": raws}
    out.with_suffix(".raw.json").write_text(json.dumps(data, separators=(",", ":"), default=str))


def with_means(groups: dict[tuple[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of each configuration, followed by their mean row where there are several."""
    table = []
    for group in groups.values():
        table += group
        if len(group) > 1:
            table.append(mean_row(group))
    return table


def summary_line(cal: dict[str, Any]) -> str:
    r = cal["restart_stats"]
    return (
        f"step {1e3 * cal['iteration_time']:.1f} ms, restart median {r['median']:.2f} s "
        f"(spread {r['spread']:.2f}, {r['n']} samples), load {cal['load_before']:.2f}->"
        f"{cal['load_after']:.2f}, CPU pressure {cal['cpu_pressure']:.2f}"
    )


@dataclasses.dataclass(frozen=True)
class Windowed:
    """A replay scored over its window: the steps the job held at ``window`` seconds, and
    the simulator's runs whose trace ends there (beforehand inputs, the replay's own)."""

    window: float
    held: int
    kills: int  # the replay's kills inside the window
    sims: list[Any]
    checks: list[Any]
    exact: list[Any]

    def columns(self) -> dict[str, float]:
        measured = self.held / self.window
        goodputs = [d.useful_steps / self.window for d in self.sims]
        predicted = statistics.fmean(goodputs)
        check = statistics.fmean(d.useful_steps / self.window for d in self.checks)
        exact = statistics.fmean(d.useful_steps / self.window for d in self.exact)
        return {
            "window_s": self.window,
            "goodput_window_measured": measured,
            "goodput_window_predicted": predicted,
            "error_window_pct": 100.0 * (predicted / measured - 1.0),
            "window_p10": float(np.percentile(goodputs, 10)),
            "window_p90": float(np.percentile(goodputs, 90)),
            # The replay's own noise, known before it ran: the spread of the goodput over
            # the seeds (restart and step times drawn as the machine gives them), relative.
            "noise_window_pct": 100.0 * statistics.stdev(goodputs) / predicted
            if len(goodputs) > 1 and predicted > 0
            else math.nan,
            "goodput_window_in_replay": check,
            "error_window_in_replay_pct": 100.0 * (check / measured - 1.0),
            "goodput_window_exact": exact,
            "error_window_exact_pct": 100.0 * (exact / measured - 1.0),
            "kills_window_measured": self.kills,
            "kills_window_predicted": statistics.fmean(d.preemptions for d in self.sims),
        }


def clear_of_kills(at: float, kills: list[float], margin: float = KILL_MARGIN) -> float:
    """``at``, moved earlier while a kill falls within ``margin`` before it: the simulator's
    trace holds a kill from the tick after it, so a kill in the window's last tick would
    count in the replay and not in the prediction (and the steps held jump back there)."""
    for kill in sorted(kills, reverse=True):
        if at - margin < kill <= at:
            at = kill - margin
    return at


def held_at(run: Any, timeline: list[tuple[float, int]], at: float) -> int:
    """The steps the job holds ``at`` seconds into the replay: the newest step reached by
    then, unless a kill came after it (and by then): then the step it resumed from (the
    first process after the kill that restored says which)."""
    reached = [(t, s) for t, s in timeline if t <= at]
    if not reached:
        return 0
    t0, step = reached[-1]
    kill = min(
        (life.ended for life in run.lives if life.killed and life.ended >= t0), default=math.inf
    )
    if kill > at:
        return step
    resumed = (
        life.start_step
        for life in run.lives
        if life.spawned >= kill and life.start_step is not None
    )
    return next(resumed, step)


def row(
    key, config, offset, c, steps, run, notices, before, own, sims, checks, exact, load, cal, scored
):
    measured = steps / run.wall
    goodputs = [d.goodput for d in sims]
    predicted = statistics.fmean(goodputs)
    check = statistics.fmean(d.goodput for d in checks)
    replayed = statistics.fmean(d.goodput for d in exact)
    return {
        **scored.columns(),
        "trace": key,
        "config": config.label,
        "policy": config.policy,
        "every": config.every or "",
        "in_flight": config.in_flight,
        "offset_gaps": f"{offset:g}",
        "compression": c,
        "steps": steps,
        "goodput_measured": measured,
        "goodput_predicted": predicted,
        "error_pct": 100.0 * (predicted / measured - 1.0),
        "predicted_p10": float(np.percentile(goodputs, 10)),
        "predicted_p90": float(np.percentile(goodputs, 90)),
        "goodput_in_replay": check,
        "error_in_replay_pct": 100.0 * (check / measured - 1.0),
        "goodput_exact": replayed,
        "error_exact_pct": 100.0 * (replayed / measured - 1.0),
        "inputs_moved_pct": 100.0 * (predicted / check - 1.0),
        "wall_measured_s": run.wall,
        "wall_predicted_s": statistics.fmean(d.wall_seconds for d in sims),
        "kills_measured": run.kills,
        "kills_predicted": statistics.fmean(d.preemptions for d in sims),
        "lost_steps_measured": run.lost_steps,
        "lost_steps_predicted": statistics.fmean(d.lost_steps for d in sims),
        "commits_measured": run.commits,
        "commits_predicted": statistics.fmean(d.saves - d.saves_lost for d in sims),
        "notices": notices,
        "emergency_saves_predicted": statistics.fmean(d.emergency_saves for d in sims),
        "iteration_ms": 1e3 * own["iteration_time"],
        "iteration_calibrated_ms": 1e3 * before["iteration_time"],
        "restart_s": own["restart"] + own["iteration_time"],
        "restart_calibrated_s": before["restart"] + before["iteration_time"],
        "restart_jitter_s": own["restart_jitter"],
        "restart_jitter_calibrated_s": before["restart_jitter"],
        "stall_ms": 1e3 * before["stall"],
        "durable_ms": 1e3 * before["durable"],
        "load": load["load"],
        "load_calibrated": cal["load"],
        "cpu_share": load["cpu_share"],
        "cpu_share_calibrated": cal["cpu_share"],
        "cpu_pressure": load["cpu_pressure"],
        "cpu_pressure_calibrated": cal["cpu_pressure"],
        "io_pressure": load.get("io_pressure", math.nan),
        "io_pressure_calibrated": cal.get("io_pressure", math.nan),
        "steal": load.get("steal", math.nan),
        "steal_calibrated": cal.get("steal", math.nan),
    }


def mean_row(rows: list[dict]) -> dict[str, Any]:
    """Means over the shifted replays of one configuration; errors of the means."""
    out = dict(rows[0], offset_gaps="mean")
    fixed = ("every", "in_flight", "steps")
    numeric = [k for k, v in rows[0].items() if isinstance(v, int | float) and k not in fixed]
    for key in numeric:
        out[key] = statistics.fmean(r[key] for r in rows)
    for measured, predicted, error in (
        ("goodput_measured", "goodput_predicted", "error_pct"),
        ("goodput_measured", "goodput_in_replay", "error_in_replay_pct"),
        ("goodput_window_measured", "goodput_window_predicted", "error_window_pct"),
        ("goodput_window_measured", "goodput_window_in_replay", "error_window_in_replay_pct"),
        ("goodput_measured", "goodput_exact", "error_exact_pct"),
        ("goodput_window_measured", "goodput_window_exact", "error_window_exact_pct"),
    ):
        out[error] = 100.0 * (out[predicted] / out[measured] - 1.0)
    out["inputs_moved_pct"] = 100.0 * (out["goodput_predicted"] / out["goodput_in_replay"] - 1.0)
    # The shifted replays are independent draws: the noise of their mean adds in quadrature.
    out["noise_window_pct"] = mean_noise_pct(
        [
            Forecast(
                0.0,
                r["goodput_window_predicted"],
                r["noise_window_pct"] / 100.0 * r["goodput_window_predicted"],
            )
            for r in rows
        ]
    )
    return out


def verdict(rows: list[dict]) -> str:
    """The issue's criteria over the configurations (mean rows where shifted, else single)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["trace"], r["config"]), []).append(r)
    per_config = [next((r for r in g if r["offset_gaps"] == "mean"), g[0]) for g in groups.values()]
    lines = []
    for name, col in (
        ("beforehand, over the window (headline)", "error_window_pct"),
        ("beforehand, over the whole run", "error_pct"),
        ("in-replay check, over the window", "error_window_in_replay_pct"),
        ("in-replay check, over the whole run", "error_in_replay_pct"),
        ("exact replay (the event model alone), over the window", "error_window_exact_pct"),
        ("exact replay (the event model alone), over the whole run", "error_exact_pct"),
    ):
        errs = [abs(r[col]) for r in per_config]
        inside = sum(e <= TOLERANCE for e in errs)
        lines.append(
            f"- {name}: mean |error| {statistics.fmean(errs):.2f} %, max {max(errs):.2f} %, "
            f"{inside} of {len(errs)} configurations within {TOLERANCE:g} %"
        )
    lines += noise_lines(per_config, [len(g) for g in groups.values()])
    moved = [r for r in per_config if abs(r["inputs_moved_pct"]) > 2.0]
    for r in moved:
        lines.append(
            f"- {r['trace']} {r['config']}: the inputs moved {r['inputs_moved_pct']:+.1f} % "
            f"between calibration and replay (step {r['iteration_calibrated_ms']:.1f} -> "
            f"{r['iteration_ms']:.1f} ms, restart {r['restart_calibrated_s']:.2f} -> "
            f"{r['restart_s']:.2f} s, load {r['load_calibrated']:.2f} -> {r['load']:.2f}, "
            f"CPU share {r['cpu_share_calibrated']:.2f} -> {r['cpu_share']:.2f}, CPU pressure "
            f"{r['cpu_pressure_calibrated']:.2f} -> {r['cpu_pressure']:.2f}, I/O pressure "
            f"{r.get('io_pressure_calibrated', math.nan):.2f} -> "
            f"{r.get('io_pressure', math.nan):.2f}, CPU stolen "
            f"{r.get('steal_calibrated', math.nan):.3f} -> {r.get('steal', math.nan):.3f})"
        )
    return "\n".join(lines) + "\n\n"


def noise_lines(per_config: list[dict], replays: list[int]) -> list[str]:
    """The headline's errors against the replays' own noise (``noise_window_pct``, known
    before they ran): which configurations the replays cannot check to ``TOLERANCE`` at
    all (and how many shifted replays would), and which errors lie beyond the noise (the
    inputs moved, or the model is off)."""
    known = [
        (r, n)
        for r, n in zip(per_config, replays, strict=True)
        if math.isfinite(r.get("noise_window_pct", math.nan))
    ]
    if not known:
        return []
    coarse = [(r, n) for r, n in known if SIGMAS * r["noise_window_pct"] > TOLERANCE]
    # An error under the table's 0.01 % counts as none (every seed may agree: no noise).
    beyond = [
        r
        for r, _ in known
        if abs(r["error_window_pct"]) > max(SIGMAS * r["noise_window_pct"], 0.01)
    ]

    def name(r: dict) -> str:
        return f"{r['trace']} `{r['config']}`"

    needed = (
        f"{name(r)} ({r['noise_window_pct']:.1f} % with {n}, "
        f"{replays_needed(r['noise_window_pct'], n)} needed)"
        for r, n in coarse
    )
    scored = [r for r, _ in known if r["noise_window_pct"] > 0]
    rms_z = (
        math.sqrt(
            statistics.fmean((r["error_window_pct"] / r["noise_window_pct"]) ** 2 for r in scored)
        )
        if scored
        else math.nan
    )
    return [
        f"- the noise model: the errors are {rms_z:.2f} x the predicted noise (root mean "
        f"square over {len(scored)} configurations; 1 where the replays' own noise is all "
        "there is, above it where the inputs moved or the model is off)",
        f"- the replays' own noise (predicted before they ran, `noise_window_pct`): "
        f"{len(coarse)} of {len(known)} configurations cannot be checked to {TOLERANCE:g} % "
        f"({SIGMAS:g} x their noise exceeds it; shifted replays that would do): "
        + ("; ".join(needed) or "none"),
        checkable_line([r for r, _ in known if SIGMAS * r["noise_window_pct"] <= TOLERANCE]),
        f"- errors beyond {SIGMAS:g} x the noise (the inputs moved, or the model is off): "
        + (
            "; ".join(f"{name(r)} {r['error_window_pct']:+.1f} % = {_in_noise(r)}" for r in beyond)
            or "none"
        ),
    ]


def checkable_line(fine: list[dict]) -> str:
    """The headline over the configurations ``fine`` whose replays can check it: their noise
    was known, before they ran, to fit twice in the tolerance (the rest are named above;
    their errors still count in the lines before)."""
    if not fine:
        return "- no configuration's replays can check the tolerance"
    errs = [abs(r["error_window_pct"]) for r in fine]
    inside = sum(e <= TOLERANCE for e in errs)
    return (
        f"- beforehand, over the window, the {len(fine)} configurations their replays can "
        f"check (named before they ran): mean |error| {statistics.fmean(errs):.2f} %, max "
        f"{max(errs):.2f} %, {inside} of {len(fine)} within {TOLERANCE:g} %"
    )


def sizing_paragraph(sizings: dict[tuple[str, str], Sizing]) -> str:
    """How many replays each configuration got, sized by its own noise before they ran
    (``replay_sizing``): those that got more than their least, and those no affordable
    number could check."""
    if not sizings:
        return ""
    more = [f"{k} `{c}` {s.describe()}" for (k, c), s in sizings.items() if s.added]
    cannot = [f"{k} `{c}` {s.describe()}" for (k, c), s in sizings.items() if not s.checkable]
    return (
        "Replays sized by their own noise before they ran (`--max-replays`): "
        + (f"more shifted replays for {'; '.join(more)}. " if more else "none needed more. ")
        + (
            f"Not checkable to {TOLERANCE:g} % by that many: {'; '.join(cannot)}.\n\n"
            if cannot
            else f"Every configuration checkable to {TOLERANCE:g} %.\n\n"
        )
    )


def _in_noise(r: dict) -> str:
    """A configuration's headline error in units of its noise (none: every seed agreed)."""
    noise = r["noise_window_pct"]
    return f"{r['error_window_pct'] / noise:+.1f} x its noise" if noise > 0 else "no noise"


def _ms(stats: dict[str, float]) -> str:
    return f"{1e3 * stats['median']:.1f} ms (spread {1e3 * stats['spread']:.1f})"


def calibration_paragraph(key: str, cal: dict) -> str:
    """One calibration as the results file states it (``key``: the trace it was made
    before, or "" when one calibration served every replay)."""
    r, n = cal["restart_stats"], cal["costs"]
    costs = "; ".join(
        f"N={k}: stall {_ms(v['stall'])} (the loop's cost per save; the engine's own figure "
        f"{_ms(v['engine_stall']) if 'engine_stall' in v else 'n/a'}), durable "
        f"{_ms(v['durable'])} ({v['durable']['n']} saves)"
        for k, v in n.items()
    )
    when = {"": "before every replay", "after": "after every replay"}.get(
        key, f"before the {key} replays"
    )
    settle = cal.get("settle")
    if settle:
        state = "quiet" if settle["quiet"] else "still busy, measured anyway"
        waited = (
            f" It waited {settle['waited_s']:.0f} s for a quiet machine ({state}: load "
            f"{settle['load_at_start']:.2f}, CPU pressure {settle['pressure_at_start']:.2f} "
            f"over the last 10 s)."
        )
    else:
        waited = ""
    samples = " ".join(f"{s:.2f}" for s in cal["restart_samples"])
    return (
        f"**Calibration, {when}** (medians; spread = 1.4826 x MAD): step "
        f"{1e3 * cal['iteration_time']:.1f} ms (bare loop {1e3 * cal['iteration_bare']:.1f} ms), "
        f"restart {r['median']:.2f} s (spread {r['spread']:.2f} s, min {r['min']:.2f}, max "
        f"{r['max']:.2f}, {r['n']} kills: {samples}); "
        f"{costs}. Load average {cal['load_before']:.2f} before, {cal['load_after']:.2f} after; "
        f"CPU share {cal['cpu_share']:.2f}; CPU pressure {cal['cpu_pressure']:.2f} (the share "
        "of the time some task waited for a CPU, `/proc/pressure/cpu`); I/O pressure "
        f"{cal.get('io_pressure', math.nan):.2f} (the same for the disk); CPU stolen by the "
        f"hypervisor {cal.get('steal', math.nan):.3f}.{waited}\n\n"
    )


def drift_paragraph(cals: dict[str, dict]) -> str:
    """How far the machine moved between the first calibration and the one after every
    replay: what no calibration made before a replay can know."""
    if "after" not in cals or len(cals) < 2:
        return ""
    first, after = next(iter(cals.values())), cals["after"]
    step = after["iteration_time"] / first["iteration_time"] - 1.0
    restart = after["restart_stats"]["median"] - first["restart_stats"]["median"]
    return (
        f"**The machine's drift over the campaign** (the first calibration vs the one after "
        f"every replay): step {1e3 * first['iteration_time']:.1f} -> "
        f"{1e3 * after['iteration_time']:.1f} ms ({100 * step:+.1f} %), restart "
        f"{first['restart_stats']['median']:.2f} -> {after['restart_stats']['median']:.2f} s "
        f"({restart:+.2f} s), load {first['load']:.2f} -> {after['load']:.2f}, CPU stolen "
        f"{first.get('steal', math.nan):.3f} -> {after.get('steal', math.nan):.3f}.\n\n"
    )


def write_outputs(
    args: argparse.Namespace,
    rows: list[dict],
    cals: dict[str, dict],
    seconds: float,
    planned: int,
    sizings: dict[tuple[str, str], Sizing] | None = None,
) -> None:
    out = Path(args.out)
    write_csv(rows, out.with_suffix(".csv"), header=csv_header())
    traces = ", ".join(
        f"{k} `{t.path}` (mean gap {t.gap:g} s, {t.steps} steps x {args.steps_scale:g})"
        for k, t in args.setups.items()
    )
    text = header(
        "Validation: simulator vs real replays with SIGKILLs, predicted beforehand",
        f"Size `{args.size}`, {sum(r['offset_gaps'] != 'mean' for r in rows)} of {planned} "
        f"replays, {seconds / 60:.1f} min. Traces: {traces}; "
        f"offsets {', '.join(f'{o:g}' for o in args.offsets)} mean gaps (each policy once per "
        f"offset, each fixed interval at {'every one' if args.fixed_offsets == 'all' else 'one'}; "
        f"more, up to {args.max_replays}, where a configuration's own noise needs them). "
        "Training child: the real engine asking the real "
        f"interval policy at every step, a real MLP (10 MB of state) whose steps also sleep "
        f"{args.accelerator_ms:g} ms for the accelerator (`replay_child.py`); `notice:N` gets a "
        f"notice file {args.notice_lead:g} s before each kill (the traces' 30-120 s notices "
        "compressed with the rest would be under 0.2 s). Policies "
        + (
            "seeded with the calibrated costs as priors. "
            if args.seeded
            else "with default priors. "
        )
        + "\n\n"
        + "".join(calibration_paragraph(key, cal) for key, cal in cals.items())
        + drift_paragraph(cals)
        + "`goodput_window_predicted` (the headline): the simulator from the calibration only, "
        f"the mean over {args.draws} seeds of restart and step times drawn with the calibrated "
        "spread (p10-p90 beside it), the policy asked at every step, scored over the replay's "
        f"window (`window_s`: {WINDOW:g} x the shortest predicted wall, fixed before the "
        "replay; the steps the job holds by then, divided by it; in the simulator its trace "
        "ends there). `goodput_predicted` vs `goodput_measured`: the same over the whole run "
        "(steps / wall), where the end of a short replay races its last kills. "
        "`goodput_in_replay`: the check of the event model, the same from this replay's own "
        "restart and step times (their means and spread, drawn). `goodput_exact`: the event model "
        "alone, the simulator fed this replay's restarts and paces start by start "
        "(`JobSpec.measured_starts`; nothing drawn, only the kill ticks' "
        f"{1e3 * TICK:g} ms grid differs). "
        "`inputs_moved_pct` = predicted / in-replay - 1: what the move of the inputs between "
        "calibration and replay did, to be read with `load` vs `load_calibrated` (1-minute load "
        "average, the replay's own child adds ~1), `cpu_share` and `cpu_pressure`. `mean` rows "
        "compare the mean measured goodput over the shifted replays with the mean prediction.\n\n"
        + verdict(rows)
        + sizing_paragraph(sizings or {}),
    )
    cols = [
        "trace",
        "config",
        "offset_gaps",
        "window_s",
        "goodput_window_measured",
        "goodput_window_predicted",
        "error_window_pct",
        "window_p10",
        "window_p90",
        "noise_window_pct",
        "error_window_in_replay_pct",
        "error_window_exact_pct",
        "kills_window_measured",
        "kills_window_predicted",
        "goodput_measured",
        "goodput_predicted",
        "error_pct",
        "predicted_p10",
        "predicted_p90",
        "goodput_in_replay",
        "error_in_replay_pct",
        "error_exact_pct",
        "inputs_moved_pct",
        "wall_measured_s",
        "wall_predicted_s",
        "kills_measured",
        "kills_predicted",
        "lost_steps_measured",
        "lost_steps_predicted",
        "commits_measured",
        "commits_predicted",
        "notices",
    ]
    text += markdown_table(rows, cols, digits=2)
    text += "\nInputs (calibrated before vs measured in the replay) and the machine's load:\n\n"
    inputs_cols = [
        "trace",
        "config",
        "offset_gaps",
        "compression",
        "iteration_calibrated_ms",
        "iteration_ms",
        "restart_calibrated_s",
        "restart_s",
        "restart_jitter_calibrated_s",
        "restart_jitter_s",
        "stall_ms",
        "durable_ms",
        "load_calibrated",
        "load",
        "cpu_share_calibrated",
        "cpu_share",
        "cpu_pressure_calibrated",
        "cpu_pressure",
        "io_pressure_calibrated",
        "io_pressure",
        "steal_calibrated",
        "steal",
    ]
    text += markdown_table(rows, inputs_cols, digits=2)
    write_results(out.with_suffix(".md"), text)
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
