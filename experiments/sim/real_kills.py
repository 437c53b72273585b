"""The EuroMLSys '26 cost claim with real kills: spot + on-demand under PA and the hybrid
resource policy, against spot with a fixed interval and on-demand only, replayed on priced
spot traces with a real model training, real SIGKILLs and real restarts, beside the
simulator's prediction of each replay made from a calibration measured before it.

What is real and what stands for something:

* **Real**: the training process (``replay_child.py``: a real model and optimizer, the real
  engine asking the real interval policy at every step), its checkpoints (files, fsync,
  commit), the SIGKILL when the trace takes the spot VMs away, the restart and restore, the
  planned stop when the resource policy changes VMs (the child saves, drains and exits), and
  the resource policy and availability predictor themselves (the shipped objects, asked on
  the replay's clock with the capacity seen so far).
* **Stands for**: a job of ``n`` VMs is one process whose step is paced to the data-parallel
  step time of ``n`` VMs (``JobSpec.step_time``: the 1-VM step over ``n x 0.9^log2 n``); the
  VMs are billed at the trace's prices for as long as the job holds them (start-up and
  restore included), as the simulator bills them.
* **Time is compressed** per trace so that a restart measured here (process start, imports,
  restore, first step: ~2 s) stands for the job preset's restart (V100: 300 s, H100: 600 s):
  every trace time (ticks, resource interval, dwell, predictor half-life, the fixed interval)
  is divided by the same factor. The predictor first sees ``WARM_UP`` of the trace's history
  before the replayed window (what a user has when the job starts), in the replay and in
  the prediction alike.

Configurations per trace (the simulator's experiment 3, ``exp3_resources.py``):

* ``on-demand``: one on-demand VM, PA intervals;
* ``spot fixed``: one spot VM, a checkpoint every 30 min of trace time (``FixedSteps``);
* ``PA + hybrid``: PA intervals, ``HybridAvailability`` (availability < 0.3: one on-demand VM;
  > 0.7: spot, scaled out to 4 VMs at availability 1; 30 min dwell) fed by ``EwmaRate`` (6 h
  half-life), decisions every 30 min of trace time.

Notices: where the zone warns before a preemption (the GCP zones: 30 s, ~0.1 s compressed,
more than a save here takes to be durable) a notice file is written that long before each
drop of the spot capacity and read by the child of a spot VM; both spot configurations then
run their interval policy inside ``NoticeDriven`` (``+notice``), as the simulator does with
``JobSpec.notice_window``.

    python experiments/sim/real_kills.py                 # ~50 min here
    python experiments/sim/real_kills.py --size quick    # smoke, ~4 min
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import queue
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import RESULTS, csv_header, header, write_results
from profiles import job_for as preset_job
from replay_setup import Config, LoadProbe, make_policy, seeded_priors, settle_args
from validate_replay import WORKLOAD, NoticeWriter, ReplayChild, calibrate, inputs

import pcframe.policies as P
from pcframe.apps.preemption.supervisor import (
    EOF,
    Life,
    child_env,
    kill_group,
    pump_lines,
    record_line,
)
from pcframe.errors import SupervisorError
from pcframe.format.manifest import MANIFEST_NAME, read_manifest
from pcframe.policies.base import Preempted
from pcframe.policies.resource import ResourceDecision
from pcframe.policies.traces import Trace, load_traces, shared_traces_dir
from pcframe.sim import JobSpec, SimOptions, simulate
from pcframe.sim.capacity import Capacity
from pcframe.sim.report import markdown_table, write_csv
from pcframe.store.directory import CheckpointDir

HOUR = 3600.0
WARM_UP = 48 * HOUR  # trace seconds the predictor sees before the replayed window
RESOURCE_INTERVAL = 1800.0  # trace seconds between two resource decisions (and the dwell)
HALF_LIFE = 6 * HOUR  # the availability predictor's half-life, trace seconds
FIXED_INTERVAL = 1800.0  # trace seconds between two checkpoints of "spot fixed"
SCALING = 0.9  # data-parallel efficiency per doubling of VMs (the job presets')
MAX_SPOT = 4
NOTICE_MARGIN_TRACE = 5.0  # NoticeDriven's default margin, trace seconds
OPEN_ENDED = 10**7  # the child's --steps: the window ends the job, not a step count
STOP_TIMEOUT = 120.0  # seconds a planned stop may take before the replay gives up

# Three priced availability traces of two families (0.47, 0.76 and 0.91 of the time up over
# the whole trace) whose replayed window holds preemptions (some zones' windows after the
# warm-up hold none: us-west-2c, us-east4-a).
TRACES = ["us-east-1c_v100_1", "us-east-2a_v100_1", "us-central1-b_h100_16"]
CONFIGS = ["on-demand", "spot fixed", "PA + hybrid"]
SIZES: dict[str, dict[str, Any]] = {
    "campaign": dict(traces=TRACES, window=300.0, restarts=5, draws=12),
    "quick": dict(traces=TRACES[1:2], window=40.0, restarts=3, draws=4),
}


# --- the traces, compressed -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """One trace as replayed: compressed by ``factor`` (trace seconds per wall second), the
    window [``start``, ``start + window``) in wall seconds of the compressed trace."""

    trace: Trace  # the original
    compressed: Trace
    factor: float
    start: float
    window: float
    job: JobSpec  # the preset the compression is taken from
    notice: float = 0.0  # wall seconds of warning before a preemption (0: the zone gives none)

    @property
    def end(self) -> float:
        return self.start + self.window

    @property
    def notice_margin(self) -> float:
        """``NoticeDriven``'s default margin (5 s of trace time), compressed as every trace
        time is: the validation's 0.25 s would exceed the ~0.13 s notices and no notice
        would ever be acted on."""
        return NOTICE_MARGIN_TRACE / self.factor

    def options(self, seed: int = 0) -> SimOptions:
        return SimOptions(
            start=self.start,
            duration=self.window,
            resource_interval=RESOURCE_INTERVAL / self.factor,
            seed=seed,
            use_hints=False,
        )


def setup_for(trace: Trace, restart: float, window: float, warm_up: float = WARM_UP) -> Setup:
    """``trace`` compressed so that ``restart`` wall seconds stand for its preset's restart,
    the window starting after ``warm_up`` trace seconds of history."""
    job = preset_job(trace)
    factor = job.restart_cost / restart
    compressed = dataclasses.replace(
        trace, step_seconds=trace.step_seconds / factor, start_time=None, path=None
    )
    start = warm_up / factor
    horizon = trace.n_ticks * compressed.step_seconds
    if start + window > horizon:
        raise ValueError(f"trace {trace.name}: a window of {window} s does not fit after warm-up")
    return Setup(trace, compressed, factor, start, window, job, job.notice_window / factor)


def warmed_predictor(setup: Setup) -> P.EwmaRate:
    """The availability predictor, shown the trace's history before the window."""
    predictor = P.EwmaRate(halflife=HALF_LIFE / setup.factor)
    trace = setup.compressed
    for k in range(int(setup.start / trace.step_seconds + 1e-9)):
        predictor.observe_capacity(k * trace.step_seconds, int(trace.up[k]), trace.capacity)
    return predictor


@dataclasses.dataclass
class Choice:
    """One configuration: the interval policy, the resource policy, the predictor."""

    label: str
    interval: Callable[[], P.IntervalPolicy]
    resource: Callable[[], P.ResourcePolicy]
    predictor: Callable[[], P.EwmaRate | None]
    config: Config


def choices(setup: Setup, cal: dict[str, Any]) -> dict[str, Choice]:
    priors = seeded_priors(inputs(cal, 2))
    mtbf = setup.trace.mtbf() / setup.factor
    margin = setup.notice_margin
    pa = Config("pa", 2)
    every = max(1, round(FIXED_INTERVAL / setup.factor / cal["iteration_time"]))
    # Where the zone warns before a preemption, both spot configurations act on it.
    on_notice = setup.notice > 0
    fixed = Config("fixed", 2, every, on_notice)
    spot_pa = Config("pa", 2, on_notice=on_notice)
    dwell = RESOURCE_INTERVAL / setup.factor

    def hybrid() -> P.ResourcePolicy:
        return P.HybridAvailability(
            low=0.3, high=0.7, base_vms=1, max_spot_vms=MAX_SPOT, min_dwell=dwell
        )

    return {
        "on-demand": Choice(
            "on-demand",
            lambda: make_policy(pa, mtbf, priors),
            lambda: P.OnDemandOnly(1),
            lambda: None,
            pa,
        ),
        "spot fixed": Choice(
            "spot fixed",
            lambda: make_policy(fixed, mtbf, priors, margin=margin),
            lambda: P.SpotOnly(1),
            lambda: None,
            fixed,
        ),
        "PA + hybrid": Choice(
            "PA + hybrid",
            lambda: make_policy(spot_pa, mtbf, priors, margin=margin),
            hybrid,
            lambda: warmed_predictor(setup),
            spot_pa,
        ),
    }


# --- the real replay ------------------------------------------------------------------------


class Child:
    """One training process standing for ``vms`` VMs: spawned, its lines read into ``life``,
    stopped (planned) or killed (preempted)."""

    def __init__(
        self,
        spec: ReplayChild,
        life: Life,
        begin: float,
        log: Path,
        vms: tuple[int, int],
        wanted: tuple[int, int],
    ) -> None:
        self.spec, self.life, self.begin, self.log = spec, life, begin, log
        self.vms = vms  # (spot, on-demand) it holds
        self.wanted = wanted  # what the resource policy asked for when it started
        Path(spec.stop_file).unlink(missing_ok=True)
        with open(log, "w") as stderr:
            self.proc = subprocess.Popen(
                spec.command(),
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=child_env(None, 1),
                start_new_session=True,
            )
        self.lines: queue.Queue[Any] = queue.Queue()
        self.reader = threading.Thread(
            target=pump_lines, args=(self.proc.stdout, self.lines), daemon=True
        )
        self.reader.start()

    def run_until(
        self, deadline: float, until: Callable[[Life], bool] = lambda life: False
    ) -> None:
        """Reads the child's lines until ``deadline`` (seconds on the replay clock) or until
        ``until(life)``, and those already written at the deadline; a child that ends on its
        own has failed."""
        while not until(self.life):
            wait = deadline - (time.monotonic() - self.begin)
            try:
                item = self.lines.get(timeout=wait) if wait > 0 else self.lines.get_nowait()
            except queue.Empty:
                return
            if item is EOF:
                self.proc.wait()
                tail = self.log.read_text(errors="replace").splitlines()[-15:]
                raise SupervisorError(
                    f"training process {self.life.index} ended by itself (code "
                    f"{self.proc.returncode}):\n" + "\n".join(tail)
                )
            record_line(item[1], self.life, item[0] - self.begin)

    def stop(self) -> float:
        """A planned stop: the child saves this step and drains; returns when its newest step
        is durable (its ``committed`` line), as the simulator's stop ends when the save has
        drained: the engine's close and the interpreter's teardown after that cost the job
        nothing (the VMs are given back)."""
        self.run_until(0.0)  # the lines written so far: has it trained a step?
        if self.life.first_step_at is None:
            # Still starting (imports, restore): nothing of its own to save, as in the
            # simulator's stop before ``ready``; its VMs are given back at once.
            self.kill()
            return self.life.ended
        Path(self.spec.stop_file).write_text("stop")
        now = time.monotonic() - self.begin
        self.run_until(now + STOP_TIMEOUT, drained)
        if not drained(self.life):
            raise SupervisorError(f"process {self.life.index} did not stop in {STOP_TIMEOUT} s")
        self.life.ended = time.monotonic() - self.begin
        self._end()
        return self.life.ended

    def kill(self) -> None:
        self.life.killed, self.life.ended = True, time.monotonic() - self.begin
        kill_group(self.proc)
        while (item := self.lines.get()) is not EOF:  # lines written before it died
            record_line(item[1], self.life, item[0] - self.begin)
        self._end()

    def _end(self) -> None:
        kill_group(self.proc)
        self.reader.join()
        self.proc.stdout.close()


def drained(life: Life) -> bool:
    """Whether a stopping child's newest step is durable (or it has said ``done``)."""
    return life.done is not None or bool(
        life.commit_steps and life.commit_steps[-1] >= life.last_step
    )


def durable_step(directory: Path) -> int:
    """The step of the newest committed version in ``directory`` (0: none): what the next
    process restores. Read from the directory, not from the children's ``committed`` lines,
    which a child prints only after its next step (a version made durable during the step a
    SIGKILL cut short is restored all the same)."""
    checkpoints = CheckpointDir(directory)
    versions = checkpoints.committed_versions()
    if not versions:
        return 0
    return read_manifest(str(checkpoints.path(versions[-1]) / MANIFEST_NAME)).step


@dataclasses.dataclass
class Outcome:
    """What a replay (or one simulated run) showed, in the simulator's terms."""

    useful_steps: float
    wall: float
    cost: float  # dollars at the trace's prices, uncompressed
    preemptions: float
    changeovers: float
    lost_steps: float
    vm_seconds: float  # VM-seconds held, compressed
    lives: list[Life] = dataclasses.field(default_factory=list)  # a real replay's processes

    @property
    def goodput(self) -> float:
        return self.useful_steps / self.wall

    @property
    def cost_per_kstep(self) -> float:
        return 1000.0 * self.cost / self.useful_steps if self.useful_steps else math.nan


def replay(setup: Setup, choice: Choice, cal: dict[str, Any], root: Path) -> Outcome:
    """Runs ``choice`` over the window for real, as ``pcframe.sim.simulate`` models it:
    resource decisions every interval and after every capacity change or preemption, a
    planned stop when the VMs change, a SIGKILL when the trace takes the spot VMs."""
    cap = Capacity(setup.compressed, setup.options())
    resource, predictor = choice.resource(), choice.predictor()
    fed = cap.tick(setup.start) - 1
    directory = root / "ckpt"
    lives: list[Life] = []
    cost = vm_seconds = 0.0
    preemptions = changeovers = lost = 0
    child: Child | None = None
    want: ResourceDecision | None = None
    kill_at = math.inf
    next_decision, decide_now = setup.start, True
    begin = time.monotonic() - setup.start  # the replay clock reads trace time
    notices = None
    if choice.config.notices and setup.notice > 0:
        # Written ``notice`` s before every drop of the spot capacity in the window (a
        # running spot job is preempted at each), removed at the drop; the child's
        # NoticeDriven reads it (FileNoticeSource).
        drops = [
            t for t in cap.change_times if setup.start < t < setup.end and cap.hits(cap.tick(t), 1)
        ]
        notices = NoticeWriter(root / "notice", drops, setup.notice)
        notices.start_time = begin
        notices.start()

    def now() -> float:
        return time.monotonic() - begin

    def bill(c: Child, until: float) -> None:
        nonlocal cost, vm_seconds
        spot, od = c.vms
        cost += cap.spot_cost(c.life.spawned, until, spot) + cap.on_demand_cost(
            c.life.spawned, until, od
        )
        vm_seconds += (spot + od) * (until - c.life.spawned)

    while (t := now()) < setup.end:
        if predictor is not None:
            for k in range(fed + 1, cap.tick(t) + 1):
                predictor.observe_capacity(k * cap.dt, int(cap.up[k]), cap.capacity)
            fed = max(fed, cap.tick(t))
        if decide_now or t >= next_decision:
            prediction = predictor.predict(t) if predictor is not None else None
            want = resource.decide(
                cap.resource_context(
                    t,
                    setup.start,
                    prediction,
                    want,
                    work_done=durable_step(directory) * cal["iteration_time"],
                    changeover=cal["restart"],
                )
            )
            next_decision, decide_now = t + RESOURCE_INTERVAL / setup.factor, False
        assert want is not None
        if child is not None and (want.spot, want.on_demand) != child.wanted:
            stopped = child.stop()
            bill(child, stopped)
            changeovers += 1
            if child.vms[0] and predictor is not None:
                predictor.advance(stopped)
            child, kill_at = None, math.inf
            continue
        if child is None:
            spot = cap.spot_available(t, want.spot) if want.spot else 0
            if spot + want.on_demand >= 1:
                life = Life(len(lives), spawned=t)
                lives.append(life)
                spec = ReplayChild(
                    directory=str(directory),
                    steps=OPEN_ENDED,
                    workload="mlp",
                    workload_args=WORKLOAD,
                    config=choice.config.label,
                    # The pace asked for (the calibration measured what it gives: the
                    # simulator's step time).
                    accelerator_ms=cal.get("paced_ms", 1e3 * cal["iteration_time"]),
                    mtbf=setup.trace.mtbf() / setup.factor,
                    priors=seeded_priors(inputs(cal, choice.config.in_flight)),
                    paced=True,
                    vms=spot + want.on_demand,
                    scaling=SCALING,
                    stop_file=str(root / f"stop-{life.index}"),
                    # Only a spot VM is warned (the simulator's notice comes with a kill).
                    notice_file=str(root / "notice") if notices and spot else None,
                    notice_lead=setup.notice,
                    notice_margin=setup.notice_margin,
                )
                log = root / f"child-{life.index}.log"
                vms, wanted = (spot, want.on_demand), (want.spot, want.on_demand)
                child = Child(spec, life, begin, log, vms, wanted)
                kill_at = cap.next_kill(t, spot) if spot else math.inf
        t_next = min(setup.end, next_decision, cap.next_change(t), kill_at)
        if child is None:
            time.sleep(max(0.0, t_next - now()))
            decide_now = True
            continue
        child.run_until(t_next)
        if t_next == kill_at and t_next < setup.end:
            child.kill()  # first: the trace's kill time is now
            committed = durable_step(directory)
            lost += max(0, child.life.last_step - committed)
            bill(child, t_next)
            if child.vms[0] and predictor is not None:
                predictor.advance(t_next)
            preemptions += 1
            resource.observe(Preempted(t_next, child.life.last_step - committed))
            if predictor is not None:
                predictor.observe(Preempted(t_next, child.life.last_step - committed))
            child, kill_at = None, math.inf
            decide_now = True
            continue
        if child.vms[0] and predictor is not None:
            predictor.advance(t_next)
        if t_next == cap.next_change(t):
            decide_now = True
    useful = 0
    if child is not None:  # the window ends: the steps done count (the job is not preempted)
        child.kill()
        useful = child.life.last_step
        bill(child, setup.end)
    if notices is not None:
        notices.stop()
    useful = max(useful, durable_step(directory))
    shutil.rmtree(directory, ignore_errors=True)
    return Outcome(
        useful, setup.window, cost * setup.factor, preemptions, changeovers, lost, vm_seconds, lives
    )


# --- the prediction -------------------------------------------------------------------------


def job_spec(setup: Setup, cal: dict[str, Any], config: Config) -> JobSpec:
    x = inputs(cal, config.in_flight)
    return JobSpec(
        iteration_time=x["iteration_time"],
        save_stall=x["stall"],
        save_duration=x["durable"],
        restart_cost=x["restart"],
        max_in_flight=config.in_flight,
        total_steps=None,
        final_save=False,
        restart_jitter=x["restart_jitter"],
        iteration_jitter=0.0,  # the step is paced: the load does not move it
        scaling_efficiency=SCALING,
        notice_window=setup.notice if config.notices else 0.0,
    )


def predict(setup: Setup, choice: Choice, cal: dict[str, Any], draws: int) -> list[Outcome]:
    job = job_spec(setup, cal, choice.config)
    out = []
    for seed in range(draws):
        r = simulate(
            setup.compressed,
            choice.interval(),
            job,
            resource=choice.resource(),
            predictor=choice.predictor(),
            options=setup.options(seed),
        )
        out.append(
            Outcome(
                r.useful_steps,
                r.wall_seconds,
                r.cost * setup.factor,
                r.preemptions,
                r.changeovers,
                r.lost_steps,
                r.spot_vm_seconds + r.on_demand_vm_seconds,
            )
        )
    return out


# --- the campaign -------------------------------------------------------------------------------


def row(case: str, setup: Setup, label: str, real: Outcome, sims: list[Outcome]) -> dict[str, Any]:
    """``case``: the trace as ``--traces`` named it (``NAME@HOURS`` for another window)."""

    def mean(key: str) -> float:
        return statistics.fmean(getattr(s, key) for s in sims)

    goodput = statistics.fmean(s.goodput for s in sims)
    kcost = statistics.fmean(s.cost_per_kstep for s in sims)
    return {
        "trace": case,
        "config": label,
        "compression": setup.factor,
        "window_trace_h": setup.window * setup.factor / HOUR,
        "goodput_measured": real.goodput,
        "goodput_predicted": goodput,
        "goodput_error_pct": 100.0 * (goodput / real.goodput - 1.0) if real.goodput else math.nan,
        "cost_per_kstep_measured": real.cost_per_kstep,
        "cost_per_kstep_predicted": kcost,
        "useful_steps_measured": real.useful_steps,
        "useful_steps_predicted": mean("useful_steps"),
        "lost_steps_measured": real.lost_steps,
        "lost_steps_predicted": mean("lost_steps"),
        "preemptions_measured": real.preemptions,
        "preemptions_predicted": mean("preemptions"),
        "changeovers_measured": real.changeovers,
        "changeovers_predicted": mean("changeovers"),
        "vm_seconds_measured": real.vm_seconds,
        "vm_seconds_predicted": mean("vm_seconds"),
    }


def versus_on_demand(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per trace: each configuration's throughput and cost per useful step over on-demand's,
    measured and predicted, and whether the paper's claim (2.04x at -51 %) holds."""
    out = []
    for name in dict.fromkeys(r["trace"] for r in rows):
        mine = {r["config"]: r for r in rows if r["trace"] == name}
        base = mine.get("on-demand")
        if base is None:
            continue
        for label in ("spot fixed", "PA + hybrid"):
            r = mine.get(label)
            if r is None:
                continue
            entry = {"trace": name, "config": label}
            for side in ("measured", "predicted"):
                x = r[f"goodput_{side}"] / base[f"goodput_{side}"]
                c = 100.0 * (r[f"cost_per_kstep_{side}"] / base[f"cost_per_kstep_{side}"] - 1.0)
                entry[f"throughput_x_{side}"] = x
                entry[f"cost_pct_{side}"] = c
                entry[f"claim_{side}"] = "yes" if x >= 2.04 and c <= -51.0 else "no"
            out.append(entry)
    return out


def claims_rows(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The "against on-demand only" table, formatted."""
    return [
        {
            "trace": e["trace"],
            "config": e["config"],
            "throughput x on-demand measured": f"{e['throughput_x_measured']:.2f}",
            "predicted": f"{e['throughput_x_predicted']:.2f}",
            "cost/step vs on-demand % measured": f"{e['cost_pct_measured']:+.1f}",
            "predicted ": f"{e['cost_pct_predicted']:+.1f}",
            "claim holds measured / predicted": f"{e['claim_measured']} / {e['claim_predicted']}",
        }
        for e in versus_on_demand(rows)
    ]


def write_outputs(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    cal: dict[str, Any],
    setups: dict[str, Setup],
    load: dict[str, Any],
    done: float,
    total: int,
) -> None:
    out = Path(args.out)
    write_csv(rows, out.with_suffix(".csv"), header=csv_header())
    replays = [
        {
            "trace": r["trace"],
            "config": r["config"],
            "goodput (steps/s) measured": f"{r['goodput_measured']:.2f}",
            "predicted": f"{r['goodput_predicted']:.2f}",
            "error %": f"{r['goodput_error_pct']:+.1f}",
            "$/1000 steps measured": f"{r['cost_per_kstep_measured']:.2f}",
            "predicted ": f"{r['cost_per_kstep_predicted']:.2f}",
            "lost steps": f"{r['lost_steps_measured']:.0f} / {r['lost_steps_predicted']:.1f}",
            "preemptions": f"{r['preemptions_measured']:.0f} / {r['preemptions_predicted']:.1f}",
            "changeovers": f"{r['changeovers_measured']:.0f} / {r['changeovers_predicted']:.1f}",
        }
        for r in rows
    ]
    claims = claims_rows(rows)
    traces = [
        {
            "trace": case,
            "source": s.trace.source,
            "availability (whole trace)": f"{float(np.mean(s.trace.up > 0)):.2f}",
            "MTBF h": f"{s.trace.mtbf() / HOUR:.1f}",
            "compression x": f"{s.factor:.0f}",
            "window": f"{s.start * s.factor / HOUR:.0f}-{s.end * s.factor / HOUR:.1f} h",
            "availability (window)": f"{window_availability(s):.2f}",
            "restart stands for s": f"{s.job.restart_cost:.0f}",
            "1-VM step stands for s": f"{cal['iteration_time'] * s.factor:.1f}",
        }
        for case, s in setups.items()
    ]
    restart = cal["restart_stats"]
    body = header(
        "The spot + on-demand cost claim with real kills",
        "EuroMLSys '26 claims 2.04x throughput at 51 % lower cost per step from spot + "
        "on-demand (the hybrid policy) against on-demand only. Here each configuration runs "
        "for real over a window of a priced trace, compressed in time: a real model trains "
        "in a child process with the real engine; the trace's preemptions SIGKILL it, the "
        "hybrid's changes of VMs stop it (save, drain, exit), a fresh process restores and "
        "goes on. A job of n VMs is one process whose step is paced to n VMs' data-parallel "
        f"step time (efficiency {SCALING} per doubling). Beside each replay: the simulator's "
        "prediction of the same window from the calibration made before any replay (mean of "
        f"{args.draws} seeds of restart jitter). See the docstring of "
        "`experiments/sim/real_kills.py` for what is real and what stands for something.",
    )
    body += (
        f"_{len(rows)} of {total} replays, {done / 60:.1f} min; calibration: paced step "
        f"{1e3 * cal['iteration_time']:.0f} ms on one VM, restart {restart['median']:.2f} s "
        f"(spread {restart['spread']:.2f}, {restart['n']} kills), stall "
        f"{1e3 * inputs(cal, 2)['stall']:.1f} ms, durable {1e3 * inputs(cal, 2)['durable']:.0f} "
        f"ms; load during the replays: 1-min load {load.get('load', math.nan):.2f}, CPU "
        f"pressure {load.get('cpu_pressure', math.nan):.2f}_\n\n"
    )
    body += "## The traces and their compression\n\n" + table(traces) + "\n\n"
    body += "## Each replay beside its prediction\n\n"
    body += "Lost steps, preemptions and changeovers: measured / predicted.\n\n"
    body += table(replays) + "\n\n"
    body += "## Against on-demand only\n\n" + table(claims) + "\n"
    if args.notes:
        body += "\n" + Path(args.notes).read_text()
    write_results(out.with_suffix(".md"), body)


def table(rows: list[dict[str, str]]) -> str:
    """Rows of already formatted cells, their keys as the headers."""
    return markdown_table(rows, list(rows[0])) if rows else "(none yet)"


def window_availability(setup: Setup) -> float:
    dt = setup.compressed.step_seconds
    a, b = int(setup.start / dt), int(setup.end / dt)
    return float(np.mean(setup.compressed.up[a:b] > 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="campaign")
    parser.add_argument(
        "--traces",
        nargs="+",
        help="priced availability traces, NAME or NAME@HOURS (the window starts after HOURS "
        f"of the trace; default {WARM_UP / HOUR:g})",
    )
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS)
    parser.add_argument("--window", type=float, help="wall seconds replayed per configuration")
    parser.add_argument("--restarts", type=int, help="kills of the restart calibration")
    parser.add_argument("--draws", type=int, help="seeds of each prediction")
    parser.add_argument("--accelerator-ms", type=float, default=150.0, help="the 1-VM step")
    parser.add_argument("--notes", help="a markdown file appended to the report")
    parser.add_argument("--nice", type=int, default=-10)
    parser.add_argument("--out", default=str(RESULTS / "sim_real_kills"))
    args = parser.parse_args()
    settle_args(args, SIZES)
    args.paced, args.notice_lead = True, 1.0  # what calibrate() reads
    torch.set_num_threads(1)
    by_name = {t.name: t for t in load_traces(shared_traces_dir())}
    cases = {text: text.partition("@") for text in args.traces}
    unknown = [text for text, (name, _, _) in cases.items() if name not in by_name]
    if unknown:
        parser.error(f"--traces: unknown {unknown}; priced availability traces: {TRACES}")
    root = Path(tempfile.mkdtemp(prefix="pcframe-real-kills-"))  # the system temp dir
    began = time.monotonic()
    try:
        cal = calibrate(args, [2], root)
        cal["paced_ms"] = args.accelerator_ms
        print(
            f"calibrated in {time.monotonic() - began:.0f} s: restart "
            f"{cal['restart_stats']['median']:.2f} s, step {1e3 * cal['iteration_time']:.1f} ms"
        )
        restart = cal["restart"] + cal["iteration_time"]
        setups = {
            text: setup_for(
                by_name[name], restart, args.window, float(hours) * HOUR if hours else WARM_UP
            )
            for text, (name, _, hours) in cases.items()
        }
        rows: list[dict[str, Any]] = []
        total = len(setups) * len(args.configs)
        probe = LoadProbe()
        for name, setup in setups.items():
            options = choices(setup, cal)
            for label in args.configs:
                choice = options[label]
                real = replay(setup, choice, cal, root)
                sims = predict(setup, choice, cal, args.draws)
                rows.append(row(name, setup, label, real, sims))
                r = rows[-1]
                print(
                    f"[{len(rows)}/{total} {time.monotonic() - began:.0f} s] {name} {label}: "
                    f"goodput {r['goodput_measured']:.2f} (predicted "
                    f"{r['goodput_predicted']:.2f}), $/1000 steps "
                    f"{r['cost_per_kstep_measured']:.2f} ({r['cost_per_kstep_predicted']:.2f})",
                    flush=True,
                )
                write_outputs(args, rows, cal, setups, {}, time.monotonic() - began, total)
        write_outputs(args, rows, cal, setups, probe.stop(), time.monotonic() - began, total)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
