"""The event loop: a job over a trace, under one interval policy and one resource policy.

Events, in trace seconds: capacity changes (ticks where the up-count moves), resource
decisions (every ``resource_interval`` and at every change or preemption), preemptions of
the job (drops that hit its spot VMs, with a notice ``notice_window`` before), the end of
the job or of the window. Between two events nothing about the VMs changes, and the
training process (:class:`~pcframe.sim.process.Process`) is advanced to the next event.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import numpy as np

from pcframe.errors import SimConfigError
from pcframe.policies.base import IntervalPolicy, Notice, Preempted, Restarted
from pcframe.policies.placement import PlacementPolicy
from pcframe.policies.predictors.base import Prediction, Predictor, checked_prediction
from pcframe.policies.resource import (
    ResourceDecision,
    ResourcePolicy,
    SpotOnly,
    checked_resource_decision,
)
from pcframe.policies.traces import Trace
from pcframe.runtime.checks import require_object
from pcframe.sim.capacity import Capacity
from pcframe.sim.process import Commit, Ledger, Process, Versions
from pcframe.sim.result import SimResult
from pcframe.sim.spec import JobSpec, SimOptions
from pcframe.sim.state import restored_completion, saved_state
from pcframe.sim.tiers import Placements, check_restart_inputs, placement_name


def simulate(
    trace: Trace,
    interval: IntervalPolicy,
    job: JobSpec | None = None,
    resource: ResourcePolicy | None = None,
    predictor: Predictor | None = None,
    options: SimOptions | None = None,
    params: dict[str, Any] | None = None,
    label: str | None = None,
    placement: PlacementPolicy | None = None,
) -> SimResult:
    """Simulate ``job`` over ``trace``; the policies are the real ``pcframe.policies`` objects.

    Args:
        trace: capacity over time (:func:`pcframe.policies.traces.load_trace`).
        interval: decides when to checkpoint; driven exactly as the engine drives it. It is
            used (mutated) by the run: pass a fresh object per simulation.
        job: iteration time, checkpoint and restart costs, ... (default :class:`JobSpec`).
        resource: spot vs on-demand and how many VMs (default: spot only, ``job.vms``).
        predictor: feeds ``availability`` and ``preemption_rate`` to the resource policy; it
            sees every capacity tick, the job's spot exposure and its preemptions.
        options: how to simulate (:class:`SimOptions`).
        params: free-form values copied into the result (sweep coordinates).
        label: the name of this run in tables (default: the interval policy's name).
        placement: the placement policy the engine would use: asked at every save which
            tiers get the version; a preemption then keeps only versions in tiers that
            survive the VM, and a restart pays ``job.restart_by_tier`` of the tier it reads
            (:mod:`pcframe.sim.tiers`). Mutated by the run: a fresh object per simulation.
            ``None``: every durable version survives, every restart costs
            ``job.restart_cost``.
    """
    began = time.process_time()
    for key, given, kind, what, example in (
        ("interval", interval, IntervalPolicy, "an interval policy", "Daly(mtbf=3600.0)"),
        ("resource", resource, ResourcePolicy, "a resource policy", "SpotOnly()"),
        ("predictor", predictor, Predictor, "a predictor", "GammaPoissonRate(3600.0)"),
        ("placement", placement, PlacementPolicy, "a placement policy", "SingleTier()"),
    ):
        # A class or a registry name failed deep inside the run ("state_dict() missing 1
        # required positional argument: 'self'", "'str' object has no attribute 'decide'").
        require_object(key, given, kind, what, example, optional=key != "interval")
    job = job or JobSpec()
    options = options or SimOptions()
    check_restart_inputs(job, placement)
    resource = resource or SpotOnly(wanted_vms(job, trace))
    sim = _Simulation(trace, interval, job, resource, predictor, options, placement)
    sim.run()
    return sim.result(params or {}, time.process_time() - began, label)


def trace_label(trace: Trace) -> str:
    """The trace's name, with its capacity when it has several VMs: SkyNomad's 4-node and
    availability traces of one zone share a file name."""
    if trace.capacity == 1:
        return trace.name
    return f"{trace.name} ({trace.capacity} {trace.unit}s)"


def wanted_vms(job: JobSpec, trace: Trace) -> int:
    """VMs the job asks for: ``job.vms``, or all of a count trace's capacity if ``None``."""
    return job.vms if job.vms is not None else trace.capacity


class _Simulation:
    def __init__(
        self,
        trace: Trace,
        interval: IntervalPolicy,
        job: JobSpec,
        resource: ResourcePolicy,
        predictor: Predictor | None,
        options: SimOptions,
        placement: PlacementPolicy | None = None,
    ) -> None:
        self.trace, self.interval, self.job = trace, interval, job
        self.placement = placement
        self.placements = None if placement is None else Placements(placement, job)
        self.resource, self.predictor, self.options = resource, predictor, options
        self.cap = Capacity(trace, options)
        self.ledger = Ledger(save_steps=[] if options.record_saves else None)
        self.commit = Commit()
        self.versions = Versions()
        self.initial_state = saved_state(interval)
        self.start, self.end = self.cap.window.start, self.cap.window.end
        _check_decision_count(options, self.end - self.start)
        self.unix0 = trace.start_time.timestamp() if trace.start_time is not None else None
        rate = None
        if options.context_rate == "trace":
            mtbf = trace.mtbf()
            rate = 0.0 if math.isinf(mtbf) else 1.0 / mtbf
        self.context_rate = rate
        self.spot_cost = self.od_cost = self.spot_vm_s = self.od_vm_s = 0.0
        self.preemptions = self.starts = self.changeovers = 0
        self._trained: list[int] = []  # indices of the processes that reached training
        self._jitter = np.random.default_rng([options.seed, 0x6A17])
        self.finish: float | None = None
        self._fed = self.cap.tick(self.start) - 1

    # --- clocks -----------------------------------------------------------------------------
    def _pclock(self, t: float) -> float:
        """The predictor's clock: unix time when the trace has one (time-of-day predictors)."""
        return t if self.unix0 is None else self.unix0 + t

    def _feed(self, t: float) -> None:
        """Show the predictor every capacity tick up to ``t``."""
        if self.predictor is None:
            return
        k_now = self.cap.tick(t)
        cap = self.cap
        for k in range(self._fed + 1, k_now + 1):
            self.predictor.observe_capacity(self._pclock(k * cap.dt), int(cap.up[k]), cap.capacity)
        self._fed = max(self._fed, k_now)

    def _predict(self, t: float) -> Prediction | None:
        if self.predictor is None:
            return None
        return checked_prediction(self.predictor, self.predictor.predict(self._pclock(t)))

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        job, cap, opts = self.job, self.cap, self.options
        t = self.start
        proc: Process | None = None
        proc_want: ResourceDecision | None = None
        proc_vms = (0, 0)
        kill_at = math.inf
        want: ResourceDecision | None = None
        next_decision = t
        decide_now = True
        while t < self.end:
            self._feed(t)
            if decide_now or t >= next_decision:
                want = self._decide_resources(t, want)
                next_decision = t + opts.resource_interval
                decide_now = False
            assert want is not None
            if proc is not None and _vms(want) != _vms(proc_want):
                # A planned change (mode or scale): save, stop, start on the new VMs.
                stopped = proc.stop(t)
                self._bill(proc, proc_vms, stopped)
                self.changeovers += 1
                proc, kill_at = None, math.inf
                if proc_vms[0] and self.predictor is not None:
                    self.predictor.advance(self._pclock(stopped))
                if stopped > t:
                    t = min(stopped, self.end)
                    continue
            if proc is None:
                spot = cap.spot_available(t, want.spot) if want.spot else 0
                if spot + want.on_demand >= job.min_vms:
                    proc_vms = (spot, want.on_demand)
                    proc_want = want
                    proc, kill_at = self._start(t, proc_vms)
            t_next = min(self.end, next_decision, cap.next_change(t), kill_at)
            if proc is None:
                self.ledger.waiting += t_next - t
                t = t_next
                decide_now = True  # capacity changed (or a decision is due)
                continue
            proc.run_until(t_next)
            if proc.finished:
                self.finish = proc.t
                self._bill(proc, proc_vms, proc.t)
                return
            if proc_vms[0] and self.predictor is not None:
                self.predictor.advance(self._pclock(t_next))
            if t_next == kill_at:
                lost = proc.kill(t_next)
                self._bill(proc, proc_vms, t_next)
                self.preemptions += 1
                self._preempted(t_next, lost)
                proc, kill_at = None, math.inf
                decide_now = True
            elif t_next == cap.next_change(t):
                decide_now = True
            t = t_next
        if proc is not None:
            proc.end_of_trace(self.end)
            self._bill(proc, proc_vms, self.end)

    def _start(self, t: float, vms: tuple[int, int]) -> tuple[Process, float]:
        job, opts = self.job, self.options
        spot, od = vms
        kill_at = self.cap.next_kill(t, spot) if spot else math.inf
        restored = self.commit.version > 0
        base = job.restart_cost
        if self.placements is not None:  # the restore reads the tier the version survived in
            base = self.placements.restart_base(restored)
        restart, step_time = self._draw_costs(job.step_time(spot + od), base)
        notice = None
        if job.notice_window > 0 and math.isfinite(kill_at):
            notice = Notice(max(kill_at - job.notice_window, t), kill_at, "trace")
        if opts.policy_state == "checkpoint":
            state = self.commit.policy_state if restored else self.initial_state
            # A fresh copy: a policy may keep (and change) the dict it is given, and the
            # same commit can be restored from again.
            self.interval.load_state_dict(copy.deepcopy(state or {}))
            if self.placements is not None:  # its state rides in the version too
                self.placement.load_state_dict(self.placements.state_to_restore(restored))
        proc = Process(
            policy=self.interval,
            job=job,
            options=opts,
            ledger=self.ledger,
            commit=self.commit,
            versions=self.versions,
            start=t,
            step_time=step_time,
            notice=notice,
            preemption_rate=self.context_rate,
            unix0=self.unix0,
            life=self.starts,
            restart_cost=restart,
            placements=self.placements,
        )
        if restored or (opts.policy_state == "process" and self.starts > 0):
            # The engine's count of starts whose state died with them (see Restarted).
            # Only processes that got as far as training count: one preempted while booting
            # never reached the engine, which counts restores.
            unseen = 0
            if opts.policy_state == "checkpoint":
                unseen = sum(1 for life in self._trained if life > self.commit.life)
                proc.pending_events.extend(
                    restored_completion(self.commit, proc.ready, job.checkpoint_bytes)
                )
            proc.pending_events.append(
                Restarted(proc.ready, restart, self.commit.step, unseen_starts=unseen)
            )
        elif opts.policy_state == "checkpoint" and self._trained:
            # Nothing to restore, but earlier processes trained and died before their first
            # commit: the engine's start count still says so (the newest of them is the
            # "previous process" of Restarted, the others are unseen).
            unseen = len(self._trained) - 1
            proc.pending_events.append(Restarted(proc.ready, restart, 0, unseen_starts=unseen))
        if kill_at > proc.ready:
            if self._trained and self._trained[0] <= self.commit.life:
                self._trained = [life for life in self._trained if life > self.commit.life]
            self._trained.append(self.starts)
        foresee = getattr(self.interval, "foresee", None)
        if callable(foresee):  # clairvoyant baselines (the oracle) learn this process's end
            foresee(kill_at, job, proc.it)
        self.starts += 1
        return proc, kill_at

    def _draw_costs(self, step_time: float, restart_cost: float) -> tuple[float, float]:
        """This start's restart time and step time: ``restart_cost`` (the job's, or that of
        the tier the restore reads) and the job's step time, or drawn around them.

        Real restarts and step times vary (start-up on a loaded machine, noisy neighbours);
        with long intervals whether a kill lands just before or just after a checkpoint
        depends on that variation, so a prediction is the mean over seeds of jittered runs.
        The draws use their own seeded stream, apart from the VM-drop draws. A replay of a
        measured run (``job.measured_starts``) takes each start's measured costs instead.
        """
        job = self.job
        if job.measured_starts is not None and self.starts < len(job.measured_starts):
            restart, factor = job.measured_starts[self.starts]  # a measured run replayed
            return restart, step_time * factor
        if not (job.restart_jitter or job.iteration_jitter):
            return restart_cost, step_time
        z_restart, z_step = self._jitter.standard_normal(2)
        restart = max(restart_cost + job.restart_jitter * z_restart, 0.0)
        factor = max(1.0 + job.iteration_jitter * z_step, 0.05)
        return restart, step_time * factor

    def _preempted(self, t: float, lost: int) -> None:
        event = Preempted(t, lost)
        if self.options.policy_state == "process":
            self.interval.observe(event)
        self.resource.observe(event)
        if self.predictor is not None:
            self.predictor.observe(Preempted(self._pclock(t), lost))

    def _decide_resources(self, t: float, current: ResourceDecision | None) -> ResourceDecision:
        job = self.job
        ctx = self.cap.resource_context(
            t,
            self.start,
            self._predict(t),
            current,
            work_done=self.commit.step * job.iteration_time,
            changeover=job.restart_cost,
            work_total=job.work_seconds,
            deadline=job.deadline,
        )
        return checked_resource_decision(self.resource, self.resource.decide(ctx))

    def _bill(self, proc: Process, vms: tuple[int, int], until: float) -> None:
        spot, od = vms
        self.spot_cost += self.cap.spot_cost(proc.start, until, spot)
        self.od_cost += self.cap.on_demand_cost(proc.start, until, od)
        self.spot_vm_s += spot * max(until - proc.start, 0.0)
        self.od_vm_s += od * max(until - proc.start, 0.0)

    # --- the answer -------------------------------------------------------------------------
    def result(self, params: dict[str, Any], seconds: float, label: str | None) -> SimResult:
        led, job = self.ledger, self.job
        stop = self.finish if self.finish is not None else self.end
        wall = stop - self.start
        finished = self.finish is not None
        met = None
        if job.deadline is not None:
            met = finished and wall <= job.deadline + 1e-9
        return SimResult(
            trace=trace_label(self.trace),
            source=self.trace.source,
            label=label or _name(self.interval),
            interval_policy=_name(self.interval),
            resource_policy=_name(self.resource),
            wall_seconds=wall,
            useful_steps=self.commit.step,
            lost_steps=led.lost_steps,
            time={
                "useful": led.useful,
                "lost": led.lost,
                "stall": led.stall,
                "restart": led.restart,
                "waiting": led.waiting,
            },
            spot_cost=self.spot_cost,
            on_demand_cost=self.od_cost,
            spot_vm_seconds=self.spot_vm_s,
            on_demand_vm_seconds=self.od_vm_s,
            preemptions=self.preemptions,
            starts=self.starts,
            changeovers=self.changeovers,
            saves=led.saves,
            save_steps=tuple(led.save_steps or ()),
            saves_lost=led.saves_lost,
            emergency_saves=led.emergency_saves,
            decisions=led.decisions,
            fast_forwards=led.fast_forwards,
            rollbacks=led.rollbacks,
            finished=finished,
            finish_seconds=wall if finished else None,
            deadline_met=met,
            iteration_time=job.iteration_time,
            ideal_goodput=job.speedup(wanted_vms(job, self.trace)) / job.iteration_time,
            sim_seconds=seconds,
            params=dict(params),
            placement_policy=placement_name(self.placement),
            restores={} if self.placements is None else dict(self.placements.restores),
        )


def _vms(decision: ResourceDecision | None) -> tuple[int, int]:
    """What a decision asks for (its reason text does not matter)."""
    return (0, 0) if decision is None else (decision.spot, decision.on_demand)


def _name(policy: Any) -> str:
    return getattr(policy, "name", "") or type(policy).__name__


# More decisions than this in one window is a setting's slip (seconds typed as hours, or
# a value meant for a compressed trace), not a simulation: each costs microseconds.
MAX_DECISIONS = 10_000_000


def _check_decision_count(options: SimOptions, span: float) -> None:
    """Refuse a ``probe_gap`` or ``resource_interval`` that would ask a policy more than
    :data:`MAX_DECISIONS` times over the window (a tiny one did not end at all)."""
    for key in ("probe_gap", "resource_interval"):
        every = getattr(options, key)
        if span / every > MAX_DECISIONS:
            raise SimConfigError(
                f"sim.{key}={every!r} is invalid: it would ask the policy "
                f"{span / every:.1e} times over this {span:.0f} s window; give at least "
                f"{span / MAX_DECISIONS:.3g} s"
            )
