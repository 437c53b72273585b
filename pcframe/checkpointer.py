"""The user-facing engine: ``Checkpointer`` for a plain PyTorch training loop."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pcframe.config import EngineConfig
from pcframe.errors import CheckpointError, ManifestError, NoValidCheckpoint, SaveError
from pcframe.format.layout import Layout
from pcframe.format.tree import TensorRef, encode_tree
from pcframe.policies.base import (
    Decision,
    IntervalPolicy,
    Notice,
    PolicyContext,
    Restarted,
    SaveCompleted,
)
from pcframe.policies.fixed import FixedSteps
from pcframe.policies.notices.base import NoticeSource
from pcframe.policies.placement.base import PlacementPolicy
from pcframe.restore.reader import LoadedVersion, load_version
from pcframe.rng import capture_rng, restore_rng
from pcframe.save.pipeline import COMMITTED, PendingVersion, SavePipeline
from pcframe.store.directory import WritableCheckpointDir, version_name
from pcframe.store.tiers import Secured, Source, Tiers

log = logging.getLogger("pcframe")


@dataclass
class SaveRecord:
    """What one save cost, as measured."""

    version: int
    step: int
    nbytes: int
    status: str = "in_flight"
    stall: float = 0.0  # seconds the training thread was blocked by this save
    copy: float = 0.0  # seconds of the snapshot copy into staging
    cpu: float = 0.0  # CPU seconds the engine's threads spent on it (all stages, all threads)
    durable: float = 0.0  # seconds from save() to committed (0 unless committed)
    stage: str = ""
    error: str = ""


@dataclass
class RestoreReport:
    version: int | None = None
    step: int | None = None
    seconds: float = 0.0
    skipped: list[tuple[int, str]] = field(default_factory=list)
    tier: str | None = None  # the tier the version was read from (None without tiers)
    unavailable: list[str] = field(default_factory=list)  # tiers that could not be listed


class SaveHandle:
    """A checkpoint version on its way to disk."""

    def __init__(self, pending: PendingVersion) -> None:
        self._pending = pending

    @property
    def version(self) -> int:
        return self._pending.version

    @property
    def step(self) -> int:
        return self._pending.step

    def done(self) -> bool:
        return self._pending.finished.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the version is committed, discarded or failed; return that status.

        Raises:
            SaveError: if the version failed (the engine will not raise it a second time).
            TimeoutError: if ``timeout`` passed first.
        """
        if not self._pending.finished.wait(timeout):
            raise TimeoutError(f"checkpoint version {self.version} not durable after {timeout}s")
        if self._pending.error is not None:
            self._pending.reported = True
            raise SaveError(self.version, self.step, self._pending.stage, self._pending.error)
        return self._pending.status

    def __repr__(self) -> str:
        status = self._pending.status or "in_flight"
        return f"SaveHandle(version={self.version}, step={self.step}, status={status})"


Stateful = Any  # anything with state_dict() / load_state_dict()


class Checkpointer:
    """Concurrent, crash-safe checkpointing for a training loop.

    Args:
        directory: where versions are written (one writer process per directory).
        model, optimizer, scheduler, scaler: the usual torch objects (all optional).
        data: a stateful data position (e.g. :class:`pcframe.data.ResumableLoader`).
        stateful: more named objects with ``state_dict()`` / ``load_state_dict()``.
        extra: a JSON-able dict saved with every version and updated in place on restore.
        policy: decides when :meth:`maybe_save` saves (default: every 100 steps).
        config: engine knobs; keyword overrides (``max_in_flight=4``) are applied on top.
        tiers: replica tiers, name -> directory, URL or :class:`~pcframe.store.tiers.Tier` (or a
            configured :class:`~pcframe.store.tiers.Tiers`); ``directory`` is the primary tier.
        placement: which tiers get each version and what each keeps; its first tier names
            ``directory`` (e.g. ``MemoryThenDisk()`` with ``directory`` on /dev/shm).
        notices: preemption notice sources polled in :meth:`maybe_save`; the notice is passed
            to the policy as ``ctx.notice`` (e.g. for ``NoticeDriven`` without its own source).

    The optimizer step is gated: ``optimizer.step()`` waits until the snapshot of the weights
    it is about to change has been copied. Call :meth:`wait_for_snapshot` before changing
    parameters any other way while a save is in flight.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        data: Stateful | None = None,
        stateful: Mapping[str, Stateful] | None = None,
        extra: dict[str, Any] | None = None,
        policy: IntervalPolicy | None = None,
        config: EngineConfig | None = None,
        tiers: Tiers | Mapping[str, Any] | None = None,
        placement: PlacementPolicy | None = None,
        notices: Sequence[NoticeSource] | None = None,
        **overrides: Any,
    ) -> None:
        config = config or EngineConfig()
        if overrides:
            unknown = set(overrides) - set(config.to_dict())
            if unknown:
                raise TypeError(f"unknown engine option(s) {sorted(unknown)}")
            config = EngineConfig(**{**config.to_dict(), **overrides})
        config.check_runtime()  # e.g. copy_backend="triton" without CUDA: refuse before locking
        self.config = config
        self.model, self.optimizer, self.scheduler, self.scaler = (
            model,
            optimizer,
            scheduler,
            scaler,
        )
        self.stateful: dict[str, Stateful] = dict(stateful or {})
        if data is not None:
            self.stateful["data"] = data
        for name, obj in self.stateful.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"stateful[{name!r}] needs state_dict() and load_state_dict()")
        self.extra = extra
        self.policy = policy if policy is not None else FixedSteps(100)
        self.storage = WritableCheckpointDir(directory)
        if self.storage.removed_leftovers:
            log.info(
                "pcframe: removed leftovers of an interrupted run: %s",
                self.storage.removed_leftovers,
            )
        self._next_version = self.storage.next_version()
        self.notices = list(notices or [])
        self.notice: Notice | None = None  # the pending preemption notice, as last seen
        self.last_decision: Decision | None = None  # the policy's answer at the last maybe_save
        self.last_secured: Secured | None = None  # where the last emergency version went
        try:
            self.tiers = self._attach_tiers(tiers, placement)
            for source in self.notices:
                source.start()  # signal handlers: must run in the main thread
        except BaseException:
            self.storage.close()
            raise
        self._finished: list[PendingVersion] = []
        self._finished_lock = threading.Lock()
        self._copying: list[PendingVersion] = []  # snapshot copy not yet done
        self._unfinished: list[PendingVersion] = []  # not yet reported as finished
        self._in_flight = threading.BoundedSemaphore(config.max_in_flight)
        self._layout: Layout | None = None
        self._layout_signature: tuple | None = None
        self.records: dict[int, SaveRecord] = {}
        self.last_restore: RestoreReport | None = None
        self._last_save_step: int | None = None
        self._last_save_time: float | None = None
        self._last_call: tuple[int, float] | None = None
        self._iteration_time: float | None = None
        self._stall_ewma: float | None = None
        self._duration_ewma: float | None = None
        self._restart_cost: float | None = None
        self._closed = False
        self.pipeline = SavePipeline(config, self.storage, self._on_finished)
        if self.tiers is not None:
            self.add_commit_listener(self.tiers.on_commit)
            self.pipeline.retention_filters.append(self.tiers.retention_filter)
            self.pipeline.delta_blockers.append("storage tiers")
        self._hook = optimizer.register_step_pre_hook(self._gate) if optimizer else None
        atexit.register(self._atexit)

    # --- saving ----------------------------------------------------------------------------

    def maybe_save(
        self, step: int, metadata: dict[str, Any] | None = None, notice: Notice | None = None
    ) -> SaveHandle | None:
        """Ask the interval policy whether to save at ``step``; save if it says so."""
        decision = self.decide(step, notice)
        if not decision.save:
            return None
        handle = self.save(step, metadata, reason=decision.reason)
        if decision.emergency:
            handle.wait()
            if self.tiers is not None:  # durable in the primary; now in a tier that survives
                self.last_secured = self.tiers.secure(handle.version, step, notice)
        return handle

    def decide(self, step: int, notice: Notice | None = None) -> Decision:
        """The interval policy's answer at ``step``, without acting on it.

        Measures the iteration time, polls the notice sources and records the pending
        notice, as :meth:`maybe_save` does (which is ``decide`` plus the save it asks for);
        multi-rank jobs use it to agree on one decision before saving together.
        """
        self._check_open()
        self._report_finished()
        now = time.monotonic()
        if self._last_call is not None and step > self._last_call[0]:
            sample = (now - self._last_call[1]) / (step - self._last_call[0])
            self._iteration_time = _ewma(self._iteration_time, sample)
        self._last_call = (step, now)
        notice = notice or self._poll_notices(now)
        decision = self.policy.decide(self.context(step, now, notice))
        self.last_decision = decision
        if decision.emergency and notice is None:
            notice = self._policy_notice(now)
        self.notice = notice
        return decision

    def _attach_tiers(
        self, tiers: Tiers | Mapping[str, Any] | None, placement: PlacementPolicy | None
    ) -> Tiers | None:
        if tiers is None and placement is None:
            return None
        if not isinstance(tiers, Tiers):
            tiers = Tiers(tiers or {}, placement)
        elif placement is not None:
            tiers.placement = placement
        try:
            newest = tiers.attach(self.storage, self.config.keep_last)
        except BaseException:
            tiers.close()
            raise
        # Number new versions above every tier's, so no tier ever sees a number reused.
        self._next_version = max(self._next_version, newest + 1)
        return tiers

    def _poll_notices(self, now: float) -> Notice | None:
        """The pending notice with the earliest deadline among :attr:`notices`."""
        found = None
        for source in self.notices:
            polled = source.poll(now)
            if polled is not None and now > polled.deadline:
                source.reset()  # still alive after the deadline: a false alarm
                continue
            if polled is not None and (found is None or polled.deadline < found.deadline):
                found = polled
        return found

    def _policy_notice(self, now: float) -> Notice | None:
        # A policy with its own notice source (NoticeDriven(source=...)) decided an emergency
        # save; read the same source for the deadline the tiers must meet.
        source = getattr(self.policy, "source", None)
        return source.poll(now) if isinstance(source, NoticeSource) else None

    def context(self, step: int, now: float | None = None, notice: Notice | None = None):
        """The :class:`PolicyContext` the policy sees at ``step`` (also for custom loops)."""
        return PolicyContext(
            step=step,
            now=time.monotonic() if now is None else now,
            last_save_step=self._last_save_step,
            last_save_time=self._last_save_time,
            iteration_time=self._iteration_time,
            save_stall=self._stall_ewma,
            save_duration=self._duration_ewma,
            restart_cost=self._restart_cost,
            notice=notice,
            tier_write_times=self.tiers.write_times(self._duration_ewma) if self.tiers else {},
            wall_time=time.time(),
            in_flight=sum(1 for p in self._unfinished if not p.finished.is_set()),
        )

    def save(
        self,
        step: int,
        metadata: dict[str, Any] | None = None,
        *,
        reason: str = "",
        version: int | None = None,
    ) -> SaveHandle:
        """Start a checkpoint of the current state at ``step``; returns at once (mostly).

        Blocks only while ``max_in_flight`` versions are already in flight (backpressure),
        and, without an optimizer to gate, until the snapshot is copied. ``version`` forces
        the version number (coordinated multi-rank saves); it must be above every earlier one.
        """
        if version is not None and version < self._next_version:
            raise CheckpointError(
                f"version {version} is not above the last version {self._next_version - 1}"
            )
        self._check_open()
        self._report_finished()
        entered = time.perf_counter()
        self._in_flight.acquire()
        try:
            if version is not None:
                self._next_version = version
            pending = self._capture(step, metadata or {}, reason)
        except BaseException:
            self._in_flight.release()
            raise
        self._copying.append(pending)
        self._unfinished.append(pending)
        self.records[pending.version] = SaveRecord(pending.version, step, pending.nbytes)
        self.pipeline.submit(pending)
        if self.optimizer is None:
            pending.copy_done.wait()  # nothing gates the next update: copy before returning
        pending.stall += time.perf_counter() - entered
        self._last_save_step, self._last_save_time = step, time.monotonic()
        return SaveHandle(pending)

    def _capture(self, step: int, metadata: dict[str, Any], reason: str) -> PendingVersion:
        tree: dict[str, Any] = {}
        if self.model is not None:
            tree["model"] = self.model.state_dict()
        if self.optimizer is not None:
            tree["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            tree["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            tree["scaler"] = self.scaler.state_dict()
        tree["rng"] = capture_rng()
        tree["stateful"] = {name: obj.state_dict() for name, obj in self.stateful.items()}
        tree["policy"] = self.policy.state_dict()
        if self.extra is not None:
            tree["extra"] = _json_only(self.extra, "extra")
        refs: list[TensorRef] = []
        encoded = encode_tree(tree, "", refs)
        tensors = self._detach_from_training(refs)
        named = [(ref.path.lstrip("/"), t) for ref, t in zip(refs, tensors, strict=True)]
        signature = Layout.signature(named)
        if self._layout is None or self._layout_signature != signature:
            self._layout = Layout.build(named, self.config.chunk_bytes, self.config.tensor_align)
            self._layout_signature = signature
        cuda_ready = None
        if any(t.is_cuda for t in tensors):
            cuda_ready = torch.cuda.Event()
            cuda_ready.record()
        version = self._next_version
        self._next_version += 1
        metadata = _json_only({**metadata, "reason": reason} if reason else metadata, "metadata")
        return PendingVersion(
            version=version,
            step=step,
            layout=self._layout,
            tensors=tensors,
            tree=encoded,
            numpy_tensors=[i for i, ref in enumerate(refs) if ref.numpy],
            metadata=metadata,
            started=time.perf_counter(),
            cuda_ready=cuda_ready,
        )

    def _detach_from_training(self, refs: list[TensorRef]) -> list[torch.Tensor]:
        """Decide per tensor whether the background copy may read it later.

        Parameters and optimizer state change only in ``optimizer.step()``, which is gated on
        the copy, so they are read in place. Everything else (buffers such as batch-norm
        statistics change in the next forward; RNG and small state) is cloned right now.
        """
        gated: set[int] = set()
        if self.optimizer is not None:
            if self.model is not None:
                gated = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
            for state in self.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        gated.add(value.untyped_storage().data_ptr())
        tensors = []
        for ref in refs:
            tensor = ref.tensor
            if tensor.numel() and tensor.untyped_storage().data_ptr() in gated:
                tensors.append(tensor)
            else:
                tensors.append(tensor.clone())
        return tensors

    def _gate(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: wait for in-flight snapshots of the weights it will change."""
        still = [p for p in self._copying if not p.copy_done.is_set()]
        if still:
            start = time.perf_counter()
            for pending in still:
                pending.copy_done.wait()
            waited = time.perf_counter() - start
            still[-1].stall += waited
        self._copying = [p for p in self._copying if not p.copy_done.is_set()]

    def wait_for_snapshot(self) -> None:
        """Block until every in-flight snapshot has been copied (not necessarily persisted)."""
        self._gate(None, None, None)

    def _on_finished(self, pending: PendingVersion) -> None:
        # Pipeline thread: hand over to the training thread, which reports at its next call.
        with self._finished_lock:
            self._finished.append(pending)
        self._in_flight.release()

    def _report_finished(self) -> None:
        with self._finished_lock:
            finished, self._finished = self._finished, []
        self._copying = [p for p in self._copying if not p.copy_done.is_set()]
        self._unfinished = [p for p in self._unfinished if not p.finished.is_set()]
        errors = []
        for pending in finished:
            record = self.records[pending.version]
            record.status, record.stall, record.copy, record.cpu = (
                pending.status,
                pending.stall,
                pending.copy_seconds,
                pending.cpu_seconds,
            )
            if pending.status == COMMITTED:
                record.durable = pending.durable_at - pending.started
                self._stall_ewma = _ewma(self._stall_ewma, record.stall)
                self._duration_ewma = _ewma(self._duration_ewma, record.durable)
                self.policy.observe(
                    SaveCompleted(
                        pending.version,
                        pending.step,
                        time.monotonic(),
                        record.stall,
                        record.durable,
                        pending.nbytes,
                    )
                )
            elif pending.error is not None:
                record.stage, record.error = pending.stage, str(pending.error)
                if not pending.reported:
                    errors.append(pending)
        if errors:
            first = errors[0]
            raise SaveError(first.version, first.step, first.stage, first.error) from first.error

    def wait(self) -> None:
        """Block until every in-flight version is committed, discarded or failed.

        Raises:
            SaveError: for the first failed version not yet reported.
        """
        self._check_open()
        for _ in range(self.config.max_in_flight):
            self._in_flight.acquire()
        for _ in range(self.config.max_in_flight):
            self._in_flight.release()
        self._report_finished()

    # --- restoring ---------------------------------------------------------------------------

    def committed_versions(self) -> list[int]:
        return self.storage.committed_versions()

    def add_commit_listener(self, listener: Any) -> None:
        """Call ``listener(version, path, manifest)`` on the commit thread after each commit.

        Listeners must be quick or hand work to their own thread (uploaders, tier copies); an
        exception is logged and does not undo the commit.
        """
        self.pipeline.commit_listeners.append(listener)

    def restore(self, version: int | None = None) -> int | None:
        """Load the newest valid committed version (or ``version``); return its step.

        Versions that fail verification are skipped with the reason logged and recorded in
        :attr:`last_restore`, moved aside as ``.corrupt-vNNNNNNNN-<pid>`` (not deleted), and the
        next older one is tried. Returns ``None`` when the directory holds no checkpoint.

        Raises:
            NoValidCheckpoint: every committed version failed verification.
        """
        self.wait()
        start = time.perf_counter()
        report = RestoreReport()
        sources = self._restore_sources(version, report)
        loaded: LoadedVersion | None = None
        for source in sources:
            try:
                with source.fetch() as path:
                    loaded = load_version(path, self.config.read_threads)
                report.tier = source.tier if self.tiers is not None else None
                break
            except (ManifestError, OSError) as exc:
                reason = f"in tier {source.tier}: {exc}" if self.tiers is not None else str(exc)
                report.skipped.append((source.version, reason))
                log.warning("pcframe: skipping checkpoint version %d: %s", source.version, reason)
                source.quarantine()
        if loaded is None:
            self.last_restore = report
            if report.skipped:
                reasons = "; ".join(f"v{v}: {why}" for v, why in report.skipped)
                raise NoValidCheckpoint(f"no valid checkpoint in {self.storage.root}: {reasons}")
            return None
        self._apply(loaded)
        self._next_version = max(self._next_version, loaded.manifest.version + 1)
        report.version, report.step = loaded.manifest.version, loaded.manifest.step
        report.seconds = time.perf_counter() - start
        self.last_restore = report
        self.resumed(loaded.manifest.step)
        return loaded.manifest.step

    def resumed(self, step: int) -> None:
        """Training goes on from ``step``, whose state was just loaded: tell the policy.

        Called by :meth:`restore`, and by a multi-rank restore that loaded the state itself.
        """
        self._restart_cost = process_age()
        self._last_save_step = step
        self._last_call = None
        clean = self.storage.previous_exit_clean
        self.policy.observe(Restarted(time.monotonic(), self._restart_cost, step, clean))

    def _restore_sources(self, version: int | None, report: RestoreReport) -> list[Source]:
        """Newest first; with tiers, every tier holding a version (fallback tier by tier)."""
        if self.tiers is not None:
            sources, report.unavailable = self.tiers.sources(version)
            for reason in report.unavailable:
                log.warning("pcframe: restore cannot see tier %s", reason)
            if sources:
                self._next_version = max(self._next_version, sources[0].version + 1)
        else:
            storage = self.storage
            sources = [
                Source(
                    v,
                    "",
                    lambda v=v: contextlib.nullcontext(storage.path(v)),
                    lambda v=v: storage.quarantine(v),
                )
                for v in reversed(storage.committed_versions())
            ]
        sources = [s for s in sources if version is None or s.version == version]
        if version is not None and not sources:
            committed: Any = self.storage.committed_versions()
            if self.tiers is not None:
                committed = self.tiers.committed()
            raise CheckpointError(
                f"version {version} is not committed in {self.storage.root}"
                f"{' or any tier' if self.tiers else ''}; committed: {committed}"
            )
        return sources

    def _apply(self, loaded: LoadedVersion) -> None:
        tree = loaded.state_tree()
        where = f"version {loaded.manifest.version} ({version_name(loaded.manifest.version)})"

        def need(key: str) -> Any:
            if key not in tree:
                raise CheckpointError(
                    f"{where} has no '{key}' state, but the Checkpointer was given one; "
                    f"pass the same objects that were checkpointed"
                )
            return tree[key]

        try:
            if self.model is not None:
                self.model.load_state_dict(need("model"))
            if self.optimizer is not None:
                self.optimizer.load_state_dict(need("optimizer"))
            if self.scheduler is not None:
                self.scheduler.load_state_dict(need("scheduler"))
            if self.scaler is not None:
                self.scaler.load_state_dict(need("scaler"))
            for name, obj in self.stateful.items():
                states = need("stateful")
                if name not in states:
                    raise CheckpointError(f"{where} has no stateful object named {name!r}")
                obj.load_state_dict(states[name])
        except CheckpointError:
            raise
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"{where} does not fit the objects given to the Checkpointer: {exc}"
            ) from exc
        restore_rng(tree.get("rng", {}))
        if "policy" in tree:
            self.policy.load_state_dict(tree["policy"])
        if isinstance(self.extra, dict) and "extra" in tree:
            self.extra.clear()
            self.extra.update(tree["extra"])

    # --- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for in-flight versions, stop the threads, release the directory lock."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._hook is not None:
                self._hook.remove()
            close_policy = getattr(self.policy, "close", None)
            if callable(close_policy):
                close_policy()  # e.g. restore signal handlers, stop notice pollers
            for source in self.notices:
                source.close()
            self.pipeline.close()
            if self.tiers is not None:  # after the last commit, before the lock is released
                self.tiers.close(hurry=self.notice is not None)  # preempted: no time to drain
            if self.notice is None:  # a preempted run's restart must count as a preemption
                with contextlib.suppress(OSError):
                    self.storage.mark_clean_exit()
            self.storage.close()
            atexit.unregister(self._atexit)

    def _atexit(self) -> None:
        try:
            self.close()
        except CheckpointError as exc:
            log.error("pcframe: at exit: %s", exc)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def directory(self) -> Path:
        return self.storage.root


def _ewma(previous: float | None, sample: float, weight: float = 0.3) -> float:
    return sample if previous is None else (1 - weight) * previous + weight * sample


def _json_only(value: dict[str, Any], what: str) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be JSON-able (no tensors or objects): {exc}") from None


def process_age() -> float:
    """Seconds since this process started (Linux /proc; falls back to import time)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


_IMPORTED_AT = time.monotonic()
