"""One rank of a distributed test job: real gloo process groups, real files, real kills.

Run as ``python -m tests.distributed.worker SCENARIO --root DIR --out DIR`` by
:mod:`tests.distributed.launch` or by ``torchrun``. Each rank writes what it observed to
``OUT/<scenario>-r<rank>.json`` and tensors to ``OUT/*.safetensors``; the tests compare them.
"""

from __future__ import annotations

import os

# Under torchrun every rank shares one environment: arm the crash point for one rank and
# only in the first incarnation, before pcframe.runtime.faults reads the variable at import.
if (
    os.environ.get("TEST_CRASH_AT")
    and os.environ.get("RANK") == os.environ.get("TEST_CRASH_RANK")
    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
):
    os.environ["PCFRAME_CRASH_AT"] = os.environ["TEST_CRASH_AT"]

import argparse
import collections
import contextlib
import gc
import json
import shutil
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pcframe.distributed import DistributedCheckpointer, ReshardError
from pcframe.distributed import global_versions as rec
from pcframe.errors import CheckpointError, SaveError
from pcframe.policies import Decision, FixedSteps, ManualNoticeSource, PolicyContext
from pcframe.policies.placement import PlacementContext, PlacementDecision, PlacementPolicy
from pcframe.save.status import SaveStatus
from tests.helpers import commits_in_save_order, flip_byte

ENGINE = {"chunk_bytes": 16384, "max_in_flight": 2, "writer_threads": 2}
DELTAS = {"model/*": "xor_delta_zstd", "optimizer/state/*/exp_avg*": "xor_delta_zstd"}


class Flaky:
    """A stateful object whose state_dict() fails at one chosen save (on one rank)."""

    def __init__(self, fail_at: int | None) -> None:
        self.calls, self.fail_at = 0, fail_at

    def state_dict(self) -> dict[str, int]:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure while capturing state")
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]


class Counter:
    """Per-rank data position stand-in: samples this rank has consumed."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = int(state["seen"])


@dataclass
class Job:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: Counter

    def step(self) -> None:
        inputs, labels = torch.randn(16, 64), torch.randint(0, 10, (16,))
        loss = nn.functional.cross_entropy(self.model(inputs), labels)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.data.seen += len(inputs)

    def checkpointer(self, root: Path, **options: Any) -> DistributedCheckpointer:
        return DistributedCheckpointer(
            root,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data=self.data,
            **{**ENGINE, **options},
        )


def build(kind: str) -> Job:
    """Same initial weights on every rank; a per-rank stream for data and dropout."""
    torch.manual_seed(0)
    if kind == "ddp":
        net = nn.Sequential(
            nn.Linear(64, 128),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(128, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )
        model: nn.Module = DistributedDataParallel(net)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Dropout(0.1), nn.Linear(96, 10))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[3], mesh=mesh)  # 10 output rows: uneven shards on 3 ranks
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)
    torch.manual_seed(1000 + dist.get_rank())
    return Job(model, optimizer, scheduler, Counter())


def padded_holder() -> nn.Module:
    """A DTensor table whose global row count is padded to a multiple of the world size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    rows = -(-10 // world) * world
    mesh = init_device_mesh("cpu", (world,))
    holder = nn.Module()
    table = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)
    holder.table = nn.Parameter(distribute_tensor(table, mesh, [Shard(0)]))
    return holder


def full_state(job: Job, per_rank: bool = True) -> dict[str, torch.Tensor]:
    """Whole tensors (DTensors gathered), so states of different world sizes compare."""

    def whole(value: torch.Tensor) -> torch.Tensor:
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        return value.detach().clone().contiguous()

    out = {f"model/{k}": whole(v) for k, v in job.model.state_dict().items()}
    for index, state in job.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            out[f"optimizer/{index}/{key}"] = whole(value)
    out["scheduler/last_epoch"] = torch.tensor(job.scheduler.last_epoch)
    if per_rank:
        out["rng"] = torch.get_rng_state()
        out["data/seen"] = torch.tensor(job.data.seen)
    return out


def open_data_files(root: Path) -> list[str]:
    """The data files of versions under ``root`` this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(root)) and target.endswith(".bin"):
                found.append(target)
    return found


def live_tensors(job: Job) -> list[torch.Tensor]:
    """The model's parameters and buffers and the optimizer's state tensors as they live (not
    its step counters: those a restore replaces, as torch's load may convert them)."""
    found = [*job.model.parameters(), *job.model.buffers()]
    for param in job.model.parameters():  # in the parameters' order (a load rebuilds the dict)
        state = job.optimizer.state.get(param, {})
        found += [state[k] for k in sorted(state) if k != "step" and torch.is_tensor(state[k])]
    return found


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def roundtrip(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Save twice (concurrently in flight), train on, restore: state is the saved one."""
    rank = dist.get_rank()
    first: dict[str, torch.Tensor] = {}
    for kind in ("ddp", "fsdp"):
        job = build(kind)
        with job.checkpointer(args.root / kind) as ckpt:
            assert ckpt.restore() is None
            for step in range(1, 7):
                job.step()
                if step % 3 == 0:
                    handle = ckpt.save(step)
                    if step == 3 and kind == "ddp":
                        first = full_state(job)
            saved = full_state(job)
            save_file(saved, args.out / f"{kind}-saved-r{rank}.safetensors")
            published = handle.wait() == SaveStatus.COMMITTED
            for _ in range(3):
                job.step()
            moved_on = not same(full_state(job), saved)
            memory = [t.data_ptr() for t in live_tensors(job)]
            step = ckpt.restore()
            out[kind] = {
                "published": published,
                "moved_on": moved_on,
                "restored_step": step,
                "restored_equal": same(full_state(job), saved),
                "version": ckpt.last_restore.version,
                "globals": ckpt.global_versions(),
                "in_place_bytes": ckpt.last_restore.in_place_bytes,
                "live_bytes": sum(t.nbytes for t in live_tensors(job)),
                "same_memory": memory == [t.data_ptr() for t in live_tensors(job)],
            }
    damaged_restore(args, out, first)
    failing_save(args, out)
    try:  # the test holds the writer lock of rank-1/ here
        DistributedCheckpointer(args.root / "locked", model=nn.Linear(2, 2), **ENGINE)
        out["locked"] = None
    except CheckpointError as exc:
        out["locked"] = f"{type(exc).__name__}: {exc}"
    hooked_restore(args, out)
    holder = padded_holder()
    probe = CollectorProbe()
    stateful = {"probe": probe}
    with DistributedCheckpointer(
        args.root / "padded", model=holder, stateful=stateful, **ENGINE
    ) as ckpt:
        out["padded_published"] = ckpt.save(1).wait() == SaveStatus.COMMITTED
        # A plain module of DTensors restores its values: fresh DTensors (data_ptr 0) are
        # not mistaken for the module's own memory, so load_state_dict is not skipped.
        saved = holder.table.full_tensor().clone()
        with torch.no_grad():
            holder.table.add_(100.0)
        ckpt.restore()
        out["padded_restored"] = torch.equal(holder.table.full_tensor(), saved)
        # The multi-rank restore holds the cyclic collector off too, and gives it back.
        out["collector_paused_in_restore"] = probe.seen == [False] and gc.isenabled()
        out["gloo_held_open"] = gloo_reachable(ckpt)
    out["gloo_held_closed"] = gloo_reachable(ckpt)


def gloo_reachable(root: Any) -> list[str]:
    """The torch.distributed groups and works reachable from ``root`` through pcframe's
    objects (their attributes, containers, closures and bound methods; not through modules or
    functions' globals, which reach every group of the job). A closed checkpointer must hold
    none: it lives on in reference cycles, and a gloo object freed as late as the
    interpreter's exit aborted the process."""
    kinds = (dist.ProcessGroup, torch._C._distributed_c10d.Work)
    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, kinds):
            found.append(type(obj).__name__)
            continue
        if isinstance(obj, dict | list | tuple | set | frozenset | collections.deque):
            todo.extend(obj.values() if isinstance(obj, dict) else obj)
        elif type(obj).__module__.startswith("pcframe") and hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
        elif isinstance(obj, types.MethodType):
            todo.append(obj.__self__)
        elif isinstance(obj, types.FunctionType):
            todo.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
        elif isinstance(obj, threading.Thread):
            todo.extend([getattr(obj, "_target", None), getattr(obj, "_args", ())])
    return sorted(found)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def hooked_restore(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """A module whose state_dict() hands out copies: its tensors are not the live storage,
    so they are loaded the ordinary way (filling the copies would restore nothing)."""
    job = build("ddp")
    job.model.register_state_dict_post_hook(_cloned)
    with job.checkpointer(args.root / "hooked") as ckpt:
        job.step()
        ckpt.save(1).wait()
        saved = full_state(job)
        job.step()
        ckpt.restore()
        out["hooked_restored"] = same(full_state(job), saved)
        out["hooked_in_place_model_bytes"] = ckpt.last_restore.in_place_bytes - sum(
            t.nbytes
            for state in job.optimizer.state.values()
            for k, t in state.items()
            if k != "step"
        )


def _cloned(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key, value in list(state.items()):
        if isinstance(value, torch.Tensor):
            state[key] = value.clone()


class CollectorProbe:
    """A stateful object that records whether the collector ran while it was loaded."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def state_dict(self) -> dict[str, int]:
        return {"x": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen.append(gc.isenabled())


def damaged_restore(args: argparse.Namespace, out: dict[str, Any], first: dict) -> None:
    """A flipped byte in rank 1's newest shard: every rank falls back to the previous version."""
    damaged = args.root / "ddp-damaged"
    if dist.get_rank() == 0:
        shutil.copytree(args.root / "ddp", damaged, ignore=shutil.ignore_patterns(".writer*"))
        flip_byte(damaged / "rank-1" / "v00000002" / "data.bin", 5000)
    dist.barrier()
    job = build("ddp")
    job.step()  # optimizer state to read in place: v2's verified files are let go on its skip
    with job.checkpointer(damaged) as ckpt:
        step = ckpt.restore()
        out["damaged"] = {
            "restored_step": step,
            "skipped": ckpt.last_restore.skipped,
            "equal_to_first_save": same(full_state(job), first),
            "data_files_left_open": open_data_files(damaged),
            "in_place_bytes": ckpt.last_restore.in_place_bytes,
        }


def failing_save(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """save() fails on rank 1 only: that version is not global, training and the next go on."""
    job = build("ddp")
    flaky = Flaky(2 if dist.get_rank() == 1 else None)
    with DistributedCheckpointer(
        args.root / "failure", model=job.model, optimizer=job.optimizer,
        stateful={"flaky": flaky}, **ENGINE,
    ) as ckpt:  # fmt: skip
        outcomes = []
        for step in (1, 2, 3):
            job.step()
            try:
                handle = ckpt.save(step)
            except RuntimeError as exc:
                outcomes.append([None, False, str(exc)])
                continue
            try:
                committed = handle.wait() == SaveStatus.COMMITTED
                outcomes.append([handle.version, committed, handle.reason])
            except SaveError as exc:  # the version did not become global
                outcomes.append([handle.version, False, str(exc)])
        ckpt.wait()
        out["failure"] = {"outcomes": outcomes, "globals": ckpt.global_versions()}


def resize(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Restore a checkpoint that another world size wrote; reshard or refuse clearly."""
    rank = dist.get_rank()
    for kind in ("ddp", "fsdp"):
        job = build(kind)
        with job.checkpointer(args.root / kind) as ckpt:
            result: dict[str, Any] = {}
            if kind == "fsdp":
                try:
                    ckpt.restore(reshard=False)
                    result["refused"] = None
                except ReshardError as exc:
                    result["refused"] = str(exc)
            result["restored_step"] = ckpt.restore()
            report = ckpt.last_restore
            result.update(
                saved_world_size=report.saved_world_size,
                resharded=report.resharded,
                per_rank_state_from=report.per_rank_state_from,
            )
            save_file(full_state(job), args.out / f"{kind}-resized-r{rank}.safetensors")
            job.step()
            result["saved_after_resize"] = ckpt.save(7).wait() == SaveStatus.COMMITTED
            out[kind] = result
    holder = padded_holder()
    probe = CollectorProbe()
    stateful = {"probe": probe}
    with DistributedCheckpointer(
        args.root / "padded", model=holder, stateful=stateful, **ENGINE
    ) as ckpt:
        try:
            ckpt.restore()
            out["padded_error"] = None
        except ReshardError as exc:
            out["padded_error"] = str(exc)


def train(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Train to --steps with a save every --every steps, resuming from what is global."""
    rank = dist.get_rank()
    if rank == 0:  # what a restarted job finds, before anything touches the directory
        out["pointer_at_start"] = rec.read_pointer(args.root)
        out["records_at_start"] = rec.record_versions(args.root)
        out["next_at_start"] = rec.next_version(args.root)
    job = build("ddp")
    deltas = {"codecs": DELTAS, "full_every": 3} if args.deltas else {}
    with job.checkpointer(args.root, keep_last=1, **deltas) as ckpt:
        # Saves overlap training, two in flight: a version a rank discarded (finished after
        # the next, by design) is not global, and the retained versions asserted would move.
        commits_in_save_order(ckpt.local)
        start = ckpt.restore() or 0
        out["restored_step"] = start
        for step in range(start + 1, args.steps + 1):
            job.step()
            if step % args.every == 0:
                handle = ckpt.save(step)
                if args.sync:
                    out.setdefault("published", []).append(
                        [handle.version, handle.wait() == SaveStatus.COMMITTED]
                    )
                    print(f"step {step} version {handle.version} global", flush=True)
        ckpt.wait()
        out["globals"] = ckpt.global_versions()
    save_file(full_state(job), args.out / f"train-{args.tag}-r{rank}.safetensors")


def nodes(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """``train`` on "nodes" that share nothing: each node (``PCFRAME_NODE``) has its own
    root (``<root>/<node>``) and its own memory folder for peer copies
    (``<root>/<node>-shm``), as VMs with local disks would; with ``--remote`` every rank
    also uploads its shards to an S3 server. Saves the state at every checkpoint step and
    right after the restore (``nodes-<tag>-r<rank>-at<step>``), and records where the
    restore read each shard. ``--emergency-at`` makes one rank's policy ask for an
    emergency save (a notice on that VM); ``--notice-at`` gives one rank a notice that its
    policy does not read (``--notice-window`` s before its VM goes); ``--slow-peer`` makes
    that rank slow to take the copies it receives; ``--hold-version`` holds that version's
    local commit on ``--hold-rank`` until that rank's ``maybe_save`` at the notice's step has
    returned (its round cannot be decided meanwhile: a slow disk, on one node)."""
    rank, node = dist.get_rank(), os.environ["PCFRAME_NODE"]
    answered = threading.Event()  # the maybe_save at the notice's step returned
    if args.hold_version is not None and args.hold_rank == rank:
        _hold_commit(args.hold_version, answered)
    # ``--slow-peer``: that rank keeps no copy it receives until every rank has trained all
    # its steps (a file each), 120 s at most: a loop held up by the peer ends that wait only
    # at its deadline, which it records (a fixed 1 s per copy left only a wall-clock bound).
    trained = [args.out / f"nodes-{args.tag}-trained-r{r}" for r in range(dist.get_world_size())]
    if args.slow_peer == rank:
        from pcframe.store.tiers.peer import PeerStore

        commit = PeerStore.commit

        def slow_commit(self: Any, *a: Any) -> None:
            deadline = time.monotonic() + 120.0
            while not all(path.exists() for path in trained):
                if time.monotonic() > deadline:
                    out["peer_held_past_training"] = True
                    break
                time.sleep(0.01)
            commit(self, *a)

        PeerStore.commit = slow_commit  # type: ignore[method-assign]
    job = build("ddp")
    options: dict[str, Any] = {"replicas": args.replicas, "peer_dir": args.root / f"{node}-shm"}
    if args.remote:
        client = {"endpoint_url": args.remote_endpoint, "region_name": "us-east-1"}
        storage = {"key": "testing", "secret": "testing", "client_kwargs": client}
        options["tiers"] = {"remote": {"url": args.remote, "storage_options": storage}}
    emergency = args.emergency_at if args.emergency_rank == rank else None
    options["policy"] = RankPolicy(args.every, emergency)
    notices = ManualNoticeSource(window=args.notice_window) if args.notice_rank == rank else None
    if notices is not None:  # a notice its policy (saving every few steps) does not read
        options["notices"] = [notices]

    def snapshot(step: int) -> None:
        save_file(full_state(job), args.out / f"nodes-{args.tag}-r{rank}-at{step}.safetensors")

    calls: list[float] = []
    with job.checkpointer(args.root / node, keep_last=1, **options) as ckpt:
        start = ckpt.restore() or 0
        report = ckpt.last_restore
        out["restored_step"] = start
        out["shard_sources"] = {str(k): v for k, v in report.shard_sources.items()}
        out["peer_bytes"], out["remote_bytes"] = report.peer_bytes, report.remote_bytes
        out["lost"] = report.lost
        snapshot(start)  # the state the restore brought back
        for step in range(start + 1, args.steps + 1):
            job.step()
            if notices is not None and step == args.notice_at:
                notices.trigger(time.monotonic())
            began = time.perf_counter()
            handle = ckpt.maybe_save(step)
            calls.append(time.perf_counter() - began)
            if step == args.notice_at:
                out["notice_call"] = calls[-1]
                answered.set()
            if handle is not None:
                snapshot(step)  # the uninterrupted run's state at a checkpoint step
                out.setdefault("versions", []).append(handle.version)
                held = handle.version == args.hold_version  # not global before the notice
                if args.sync and not held:
                    handle.wait()
                    print(f"step {step} version {handle.version} global", flush=True)
                if args.wait_peers and ckpt.peers is not None and not held:  # its round ended
                    assert ckpt.peers.wait(handle.version, timeout=120), handle.version
            if ckpt.last_secured is not None and "secured" not in out:
                secured = ckpt.last_secured
                out["secured"] = [secured.version, list(secured.tiers), secured.durable]
                out["secured_reason"] = secured.reason
        if args.slow_peer >= 0:
            trained[rank].touch()
        ckpt.wait()
        out["globals"] = ckpt.global_versions()
    peers = ckpt.peers  # closed: every round it was given has ended
    out["copied"] = list(peers.status.copied) if peers is not None else []
    out["skipped"] = peers.status.skipped if peers is not None else 0
    out["received_bytes"] = peers.status.received_bytes if peers is not None else 0
    out["shadow_bytes"] = peers.status.shadow_bytes if peers is not None else 0
    out["slowest_call"] = max(calls, default=0.0)
    save_file(full_state(job), args.out / f"nodes-{args.tag}-r{rank}.safetensors")


def _hold_commit(version: int, release: threading.Event) -> None:
    """This rank's local commit of ``version`` waits until ``release`` is set (120 s at
    most): the version is written, not yet durable, so its commit round is not decided on
    any rank meanwhile."""
    import pcframe.save.commit as commit

    real = commit.Committer.commit

    def held(self: Any, write: Any) -> None:
        if write.request.version == version:
            release.wait(120.0)
        real(self, write)

    commit.Committer.commit = held  # type: ignore[method-assign]


class RankPolicy(FixedSteps):
    """Saves every ``every`` steps, asks for an emergency at ``emergency_at``; logs events.

    Its learned state (the events it saw) travels in the checkpoint, so a restore that
    brings policy state back shows in ``seen``.
    """

    def __init__(self, every: int, emergency_at: int | None = None) -> None:
        super().__init__(every)
        self.emergency_at = emergency_at
        self.seen: list[str] = []

    def decide(self, ctx: PolicyContext) -> Decision:
        if ctx.step == self.emergency_at:
            return Decision(True, "notice", emergency=True)
        return super().decide(ctx)

    def observe(self, event: Any) -> None:
        self.seen.append(type(event).__name__)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": list(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = [*state["seen"], "loaded"]


def policy(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """maybe_save: rank 0's schedule for all, rank 1's emergency for all; then a restart."""
    rank = dist.get_rank()
    job = build("ddp")
    # Deliberately different schedules: only rank 0's may count.
    mine = RankPolicy(every=3) if rank == 0 else RankPolicy(every=5, emergency_at=7)
    with job.checkpointer(args.root / "run", policy=mine) as ckpt:
        # Two in flight: a rank's version finishing after the next one is discarded there
        # (by design), and not global: the global steps asserted would miss it.
        commits_in_save_order(ckpt.local)
        saved = []
        for step in range(1, args.steps + 1):
            job.step()
            handle = ckpt.maybe_save(step)
            if handle is not None:
                saved.append(step)
                if step == 7:  # the emergency: global before maybe_save returned
                    out["emergency_global_on_return"] = (
                        handle.done() and handle.wait(0) == SaveStatus.COMMITTED
                    )
        ckpt.wait()
        out["saved_steps"] = saved
        out["global_steps"] = [ckpt.rounds[v].step for v in ckpt.global_versions()]
    again = RankPolicy(every=3) if rank == 0 else RankPolicy(every=5)
    with job.checkpointer(args.root / "run", policy=again) as ckpt:
        out["restored_step"] = ckpt.restore()
        out["restored_policy_seen"] = again.seen


def raises(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Rank 1 raises inside the ``with`` block at step 3; rank 0 trains and saves on."""
    rank = dist.get_rank()
    job = build("ddp")
    with job.checkpointer(args.root) as ckpt:
        for step in range(1, args.steps + 1):
            if rank == 1 and step == 3:
                raise RuntimeError("a bug in rank 1's training step")
            job.step()  # DDP's all-reduce: rank 0 waits here for rank 1
            ckpt.save(step)
            out["saved"] = step


def leaves(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Rank 1 vanishes (no cleanup, like a SIGKILL) just before the collective restore."""
    job = build("ddp")
    with job.checkpointer(args.root) as ckpt:
        job.step()
        ckpt.save(1).wait()  # a global version: restore reaches the verdict's collective
        if dist.get_rank() == 1:
            os._exit(3)
        try:
            ckpt.restore()
        except CheckpointError as exc:
            out["error"] = str(exc)
            raise


def _state_dict_fails(*args: Any, **kwargs: Any) -> dict[str, Any]:
    raise RuntimeError("a bug in rank 1's state_dict()")


def astray(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Rank 1 strays from the others after two global versions (``--tag``): ``grows`` (a new
    buffer at save 3), ``skips`` (no save at step 3), ``fewer`` (closes after step 2) or
    ``stalls`` (away before save 3 until rank 0 has given up on it after the 15 s protocol
    timeout), or ``fails`` (its ``state_dict()`` raises at save 3, so save 3 is lost on both
    and save 4 is global)."""
    rank = dist.get_rank()
    job = build("ddp")
    out["outcomes"] = outcomes = []
    # Only `stalls` is about the timeout; the others raise at a meeting. The timeout bounds
    # every collective of the open and of saves 1 and 2 too: 3 s, on a machine loaded by
    # other work, could end one of those first (rank 1's stall is ordered by a file, so a
    # longer timeout costs the test only its own length).
    timeout = 15.0 if args.tag == "stalls" else 60.0
    gave_up = args.out / "astray-stalls-r0-gave-up"
    try:
        with job.checkpointer(args.root, protocol_timeout=timeout) as ckpt:
            for step in range(1, 5):
                strays = rank == 1 and step == 3
                if strays and args.tag == "stalls":
                    deadline = time.monotonic() + 90.0  # the launcher's limit ends a hang
                    while not gave_up.exists() and time.monotonic() < deadline:
                        time.sleep(0.01)
                if strays and args.tag == "fewer":
                    break
                if strays and args.tag == "skips":
                    continue
                if strays and args.tag == "grows":
                    job.model.module.register_buffer("scale", torch.ones(3))
                if strays and args.tag == "fails":  # not out of step: this version is lost
                    job.model.state_dict = _state_dict_fails
                with torch.no_grad():
                    next(job.model.parameters()).add_(1.0)
                try:
                    ckpt.save(step).wait()
                    outcomes.append([step, "global"])
                except (SaveError, RuntimeError) as exc:
                    if args.tag == "stalls" and rank == 0:  # given up on rank 1: it may return
                        gave_up.touch()
                    if args.tag != "fails":
                        raise
                    outcomes.append([step, type(exc).__name__])
                finally:
                    vars(job.model).pop("state_dict", None)
    except CheckpointError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        raise


def _fail_commits(
    rank: int, failing: set[int], held_rank: int, release: Path, fail_when: threading.Event
) -> None:
    """Rank ``rank``'s local commits of the versions ``failing`` hit a full disk, at the real
    crash point after the data is synced, once ``fail_when`` is set; ``held_rank``'s first
    commit (of whichever version) waits there until the file ``release`` exists (60 s at
    most). Every version finishes on the commit thread and the rounds run in version order,
    so until then no round thread can find a later version's outcome: only the engine's own
    calls can. By version, not by count: a version whose last chunk lands after a newer
    one's is discarded without reaching the crash point."""
    import pcframe.save.commit as commit

    real, real_commit = commit.crash_point, commit.Committer.commit
    committing, count = [0], [0]

    def commit_version(self: Any, write: Any) -> None:
        committing[0] = write.request.version
        real_commit(self, write)

    def crash_point(name: str) -> None:
        if name == "data_synced":
            count[0] += 1
            if dist.get_rank() == held_rank and count[0] == 1:
                deadline = time.monotonic() + 60.0
                while not release.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            if dist.get_rank() == rank and committing[0] in failing:
                fail_when.wait(60.0)
                raise OSError(28, "No space left on device (injected)")
        real(name)

    commit.crash_point = crash_point
    commit.Committer.commit = commit_version  # type: ignore[method-assign]


def late_failure(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """A background failure on rank 1 (v2, saved at step 4) while rank 0's round of v1 is
    held back, and another one (v6) still unraised when restore() is called.

    Where rank 1's engine finds v2 (``--tag``): ``decide``: v2 has failed before
    maybe_save(5), whose decide() finds it; ``save``: v2 fails during maybe_save(6), after
    its decide() and before its local save(), which finds it. Rank 1 lets rank 0's first
    commit go on only after that maybe_save has returned or raised. No sleeps.
    """
    rank = dist.get_rank()
    found_at = {"decide": 5, "save": 6}[args.tag]
    release, fail_now = args.out / f"late_failure-{args.tag}-release", threading.Event()
    _fail_commits(rank=1, failing={2, 6}, held_rank=0, release=release, fail_when=fail_now)
    job = build("ddp")
    out["outcomes"] = outcomes = []
    with job.checkpointer(args.root, policy=FixedSteps(2), protocol_timeout=20.0) as ckpt:
        decide = ckpt.local.decide

        def decide_then_fail(step: int, *rest: Any, **options: Any) -> Decision:
            decision = decide(step, *rest, **options)
            if step == found_at == 6:  # v2 fails now: this call did not see it, save() will
                fail_now.set()
                ckpt.local._flight.wait_all()
            return decision

        if rank == 1:
            ckpt.local.decide = decide_then_fail
        for step in range(1, 9):
            job.step()
            if rank == 1 and step == found_at == 5:  # v2 has failed: decide() finds it
                fail_now.set()
                ckpt.local._flight.wait_all()
            try:
                handle = ckpt.maybe_save(step)
                outcomes.append([step, handle.version if handle else None])
            except SaveError as exc:
                outcomes.append([step, f"SaveError v{exc.version}"])
            if rank == 1 and step == found_at:
                release.touch()
        try:  # a failure not raised in the loop would be raised here (once)
            ckpt.wait()
            outcomes.append(["wait", None])
        except SaveError as exc:
            outcomes.append(["wait", f"SaveError v{exc.version}"])
        job.step()
        ckpt.save(9).wait()  # v5, global: with v6 in flight too, v5 might land second and
        job.step()  # be discarded (by design: LATEST only moves forward)
        ckpt.save(10)  # v6: fails on rank 1 and is not raised before...
        ckpt.local._flight.wait_all()  # (v6 has failed on rank 1, committed on rank 0)
        out["restored"] = ckpt.restore()  # ...the restore, which goes back to step 9
        job.step()
        out["after"] = str(ckpt.save(11).wait())


class RankOneFails(PlacementPolicy):
    """Every version to the primary and a replica; on rank 1 only, ``place()`` raises for
    version 2 (a bug in the user's policy on one rank)."""

    name = "rank_one_fails"

    @property
    def tiers(self) -> tuple[str, ...]:
        return ("local", "replica")

    def place(self, ctx: PlacementContext) -> PlacementDecision:
        if dist.get_rank() == 1 and ctx.version == 2:
            raise RuntimeError("no tier for version 2 on this rank")
        keep = (ctx.version - 1, ctx.version)
        return PlacementDecision(("local", "replica"), keep={"local": keep, "replica": keep})


class RankOneAnswersNone(FixedSteps):
    """Saves at every step; on rank 1 only, ``decide`` returns None at step 3 (a bug)."""

    def decide(self, ctx: PolicyContext) -> Decision:
        if dist.get_rank() == 1 and ctx.step == 3:
            return None  # type: ignore[return-value]
        return super().decide(ctx)


def placement_fails(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """A policy fails on rank 1 only (``--tag``). ``maybe_save``: its placement raises for
    version 2, saved at step 2 and waited for until global (so its commit, and the failure,
    come before the next call); its engine raises the PolicyError at maybe_save(3), before
    that call's meeting. ``close``: the same at the close() after version 2, before the
    close's meeting. ``save``: the same at save(3), after that save's meeting. ``interval``:
    its interval policy answers None at step 3 (maybe_save(3), before the meeting). Every
    step saves; each rank records what each call raised."""
    job = build("ddp")
    out["outcomes"] = outcomes = []
    placed = {"tiers": {"replica": args.root / "replica"}, "placement": RankOneFails()}
    ckpt = job.checkpointer(
        args.root / "ckpt",
        policy=RankOneAnswersNone(1) if args.tag == "interval" else FixedSteps(1),
        protocol_timeout=90.0,  # a hang guard only: the launcher gives the job 150 s
        **({} if args.tag == "interval" else placed),
    )
    last = 2 if args.tag == "close" else 4
    for step in range(1, last + 1):
        job.step()
        try:
            handle = ckpt.save(step) if args.tag == "save" else ckpt.maybe_save(step)
            assert handle is not None
            handle.wait()
            outcomes.append([step, "global"])
        except CheckpointError as exc:
            outcomes.append([step, f"{type(exc).__name__}: {exc}"])
    try:
        ckpt.close()
        outcomes.append(["close", "closed"])
    except CheckpointError as exc:
        outcomes.append(["close", f"{type(exc).__name__}: {exc}"])


class WithExtraState(nn.Module):
    """A layer whose get_extra_state() holds a tensor (quantization scales) and a per-rank
    counter; its optimizer keeps a list of tensors per parameter (non-tensor state)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.meta: dict[str, Any] = {"scale": None, "seen": 0}

    def get_extra_state(self) -> dict[str, Any]:
        return self.meta

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.meta = state


def values(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Non-tensor entries holding tensors, and differing per rank: saved, then restored."""
    rank = dist.get_rank()
    model = WithExtraState()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with DistributedCheckpointer(args.root, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1).wait()  # no tensor in the extra state yet
        model.meta = {"scale": torch.tensor([0.5, 2.0 + rank]), "seen": 100 + rank}
        optimizer.state[model.lin.weight]["hist"] = [torch.ones(2), torch.zeros(2) + rank]
        out["saved"] = ckpt.save(2).wait().value
    model = WithExtraState()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with DistributedCheckpointer(args.root, model=model, optimizer=optimizer) as ckpt:
        out["restored"] = ckpt.restore()
        out["skipped"] = [v for v, _ in ckpt.last_restore.skipped]
    out["scale"] = model.meta["scale"].tolist()
    out["seen"] = model.meta["seen"]
    out["hist"] = [t.tolist() for t in optimizer.state[model.lin.weight]["hist"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    scenarios = {"roundtrip": roundtrip, "resize": resize, "train": train, "policy": policy}
    scenarios.update(raises=raises, leaves=leaves, values=values, astray=astray)
    scenarios.update(late_failure=late_failure, nodes=nodes, placement_fails=placement_fails)
    parser.add_argument("scenario", choices=sorted(scenarios))
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--sync", action="store_true", help="wait for each global decision")
    parser.add_argument("--tag", default="run")
    parser.add_argument("--deltas", action="store_true", help="XOR-delta model and moments")
    parser.add_argument("--replicas", type=int, default=1, help="peer copies (nodes)")
    parser.add_argument("--emergency-at", type=int, help="a notice at this step (nodes)")
    parser.add_argument("--emergency-rank", type=int, default=-1, help="on this rank (nodes)")
    parser.add_argument("--slow-peer", type=int, default=-1, help="a slow receiver (nodes)")
    parser.add_argument("--notice-at", type=int, help="a notice source fires here (nodes)")
    parser.add_argument("--notice-rank", type=int, default=-1, help="on this rank (nodes)")
    parser.add_argument("--notice-window", type=float, default=120.0, help="its window (nodes)")
    parser.add_argument("--hold-version", type=int, help="a local commit held (nodes)")
    parser.add_argument("--hold-rank", type=int, default=-1, help="on this rank (nodes)")
    parser.add_argument(
        "--wait-peers",
        action="store_true",
        help="train on only once each version's peer round ended (nodes): every version is "
        "copied, none superseded, however slow the machine",
    )
    parser.add_argument("--remote", help="an S3 URL every rank also uploads to (nodes)")
    parser.add_argument("--remote-endpoint", help="the S3 server's URL (nodes)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    try:
        scenarios[args.scenario](args, out)
    finally:
        name = f"{args.scenario}-{args.tag}-r{dist.get_rank()}.json"
        (args.out / name).write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
