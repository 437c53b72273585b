"""One rank of the recovery benchmark's training job, launched by torchrun (see run_recovery.py).

Four local ranks play two "nodes": local ranks 0-1 are node ``a``, 2-3 node ``b``
(``PCFRAME_NODE``, set here from ``LOCAL_RANK`` before pcframe is imported). Each node has its
own checkpoint root (``<work>/<node>``) and memory folder for peer copies
(``<shm>/<node>-shm``), as VMs with local disks would.

The job trains a small GPT (DDP over gloo, AdamW) and checkpoints every ``--every`` steps
with one of these configurations (``--config``):

* ``remote``: pcframe, no peers, every rank's shards also in the S3 server; the root is a
  fresh folder per incarnation (its local disk does not survive: everything comes from S3);
* ``local``: pcframe, node-local roots + S3, ``replicas=0``;
* ``peers``: pcframe, node-local roots + S3, ``replicas=1`` (copies in the other node's memory);
* ``dcp``: ``torch.distributed.checkpoint.async_save`` through fsspec (s3fs) to the same S3
  server, one checkpoint folder per save, restored with ``dcp.load``;
* ``floor``: no checkpoint at all: a restart trains from step 0;
* ``overhead``: no kill: timed phases of training with pcframe local-only and with peers,
  alternating (``--variants``).

Every rank writes what it saw to ``<control>/inc<n>-r<rank>.json`` after every step (atomic
rename): timestamps (process start, imports, ``init_process_group``, model built, checkpointer
open, restore begin/end and its phases, first trained step), the restore report, the bytes s3fs
downloaded, peak RSS, peak /dev/shm use of its peer store, and a crc32c fingerprint of its whole
state (model, optimizer, scheduler, RNG, data position) at every save step (incarnation 0) and
right after the restore (later incarnations), so the driver can check that the restored state is
the uninterrupted run's at that step, bit for bit.
"""

from __future__ import annotations

import os
import time

T_START = time.time()
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
LOCAL_WORLD = int(os.environ.get("LOCAL_WORLD_SIZE", "4"))
NODE = "a" if max(LOCAL_WORLD // 2, 1) > LOCAL_RANK else "b"
os.environ["PCFRAME_NODE"] = NODE
INCARNATION = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def wait_for_wipe(control: Path) -> float:
    """A restarted worker waits until the driver has deleted the lost node's folders (so it
    never sees them half deleted); in practice they are gone long before it gets here."""
    if INCARNATION == 0:
        return 0.0
    marker = control / f"wiped-{INCARNATION}"
    start = time.time()
    while not marker.exists():
        if time.time() - start > 120:
            raise SystemExit(f"no {marker} after 120 s: the driver did not wipe the node")
        time.sleep(0.005)
    return time.time() - start


def early_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--config",
        required=True,
        choices=["floor", "empty", "remote", "local", "peers", "dcp", "overhead"],
    )
    parser.add_argument("--work", type=Path, required=True, help="node roots go here (disk)")
    parser.add_argument("--shm", type=Path, required=True, help="node memory folders go here")
    parser.add_argument("--control", type=Path, required=True, help="JSON logs go here")
    parser.add_argument("--s3-url", default="", help="s3://bucket/prefix of this run")
    parser.add_argument("--s3-endpoint", default="")
    parser.add_argument("--every", type=int, default=3, help="a checkpoint every N steps")
    parser.add_argument("--steps", type=int, default=30, help="incarnation 0 stops here at most")
    parser.add_argument("--after", type=int, default=2, help="steps trained after the restore")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument(
        "--peer-budget", type=int, default=0, help="bytes per rank (0: 2.5x a rank's share)"
    )
    parser.add_argument("--no-fingerprint", action="store_true")
    parser.add_argument("--variants", default="local,peers", help="overhead: phases to alternate")
    parser.add_argument("--reps", type=int, default=5, help="overhead: rounds of the variants")
    parser.add_argument("--phase-steps", type=int, default=9, help="overhead: steps per phase")
    return parser.parse_args()


ARGS = early_args()
WIPE_WAIT = wait_for_wipe(ARGS.control)

import crc32c  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

# What each configuration's job imports at its start (counted as imports, not as setup).
if ARGS.config in ("empty", "remote", "local", "peers", "overhead"):
    import pcframe.distributed  # noqa: F401
if ARGS.config == "dcp":
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint._fsspec_filesystem
    import torch.distributed.checkpoint.state_dict
if ARGS.s3_url:
    import s3fs  # noqa: F401

T_IMPORTED = time.time()


# --- what each rank records -------------------------------------------------------------------


class Log:
    """This rank's JSON record of this incarnation, rewritten atomically after every step."""

    def __init__(self, control: Path) -> None:
        self.path = control / f"inc{INCARNATION}-r{RANK}.json"
        self.data: dict[str, Any] = {
            "rank": RANK,
            "node": NODE,
            "incarnation": INCARNATION,
            "pid": os.getpid(),
            "config": ARGS.config,
            "t": {"start": T_START, "imported": T_IMPORTED},
            "wipe_wait": WIPE_WAIT,
            "step": 0,
            "fingerprints": {},
            "rss_peak": 0,
            "shm_peak": 0,
        }
        self._lock = threading.Lock()
        self.write()

    def stamp(self, name: str) -> float:
        now = time.time()
        self.data["t"][name] = now
        return now

    def write(self) -> None:
        with self._lock:
            self.data["rss_peak"] = max(self.data["rss_peak"], peak_rss())
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.path)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def folder_bytes(path: Path) -> int:
    """Bytes a folder takes in its file system (allocated blocks), each file counted once:
    a file renamed from one subfolder to another while the walk runs (the peer store moves
    the files of a dropped copy into the next one) would otherwise be seen in both."""
    total, seen = 0, set()
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                info = os.lstat(os.path.join(dirpath, name))
                if (info.st_dev, info.st_ino) not in seen:
                    seen.add((info.st_dev, info.st_ino))
                    total += info.st_blocks * 512
    return total


class ShmSampler(threading.Thread):
    """Peak bytes of this rank's peer store in the node's memory folder, sampled every 50 ms."""

    def __init__(self, folder: Path, log: Log) -> None:
        super().__init__(daemon=True, name="shm-sampler")
        self.folder, self.log = folder, log
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            used = folder_bytes(self.folder)
            if used > self.log.data["shm_peak"]:
                self.log.data["shm_peak"] = used


S3_READ = [0]  # bytes s3fs downloaded in this process


def count_s3_reads() -> None:
    """Count every byte s3fs downloads in this process (pcframe's fetches use ``_get_file``
    and ``_cat_file``, DCP's FsspecReader reads ``S3File`` ranges)."""
    import s3fs
    from s3fs.core import S3File

    get_file, cat_file, fetch_range = (
        s3fs.S3FileSystem._get_file,
        s3fs.S3FileSystem._cat_file,
        S3File._fetch_range,
    )

    async def _get_file(self: Any, rpath: str, lpath: str, *args: Any, **kwargs: Any) -> Any:
        out = await get_file(self, rpath, lpath, *args, **kwargs)
        with contextlib.suppress(OSError):
            S3_READ[0] += os.path.getsize(lpath)
        return out

    async def _cat_file(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = await cat_file(self, *args, **kwargs)
        S3_READ[0] += len(out)
        return out

    def _fetch_range(self: Any, start: int, end: int) -> Any:
        out = fetch_range(self, start, end)
        S3_READ[0] += len(out)
        return out

    s3fs.S3FileSystem._get_file = _get_file
    s3fs.S3FileSystem._cat_file = _cat_file
    S3File._fetch_range = _fetch_range


PHASES: dict[str, float] = {}  # seconds per restore phase, summed (pcframe instrumented)
PHASES_CPU: dict[str, float] = {}  # the process's CPU seconds (every thread) in each phase
RECORDS: list[Any] = []  # the global records the restore saw


def time_restore_phases() -> None:
    """Wrap pcframe's restore steps to time them (instrumentation only, nothing changed):
    listing the records, fetching the missing shards, reading + verifying, applying."""
    from pcframe.distributed import recovery, restore, verdict

    def timed(name: str, fn: Any, keep: bool = False) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.process_time()
            try:
                out = fn(*args, **kwargs)
            finally:
                PHASES[name] = PHASES.get(name, 0.0) + time.perf_counter() - start
                PHASES_CPU[name] = PHASES_CPU.get(name, 0.0) + time.process_time() - cpu
            if keep:
                RECORDS[:] = list(out[0])
            return out

        return wrapper

    recovery.Recovery.records = timed("records", recovery.Recovery.records, keep=True)
    recovery.Recovery.gather_version = timed("fetch", recovery.Recovery.gather_version)
    verdict.prepare = timed("verify", verdict.prepare)
    restore.Prepared.apply = timed("apply", restore.Prepared.apply)


# --- the model, its data, its state --------------------------------------------------------------


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


class Position:
    """The data position (per rank): batches are drawn from (rank, step), so a resumed run
    sees the batches the uninterrupted one would have."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


class Job:
    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)  # the same initial weights on every rank
        net = TinyGPT(args.vocab, args.width, args.layers, args.heads, args.seq)
        self.params = sum(p.numel() for p in net.parameters())
        self.model = DistributedDataParallel(net)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=1000)
        self.data = Position()
        self.args = args
        torch.manual_seed(1000 + dist.get_rank())  # a per-rank stream for dropout

    @property
    def state_bytes(self) -> int:
        """Model + AdamW moments (float32): the checkpoint's size, each tensor written once."""
        return 3 * 4 * self.params

    def step(self) -> None:
        g = torch.Generator().manual_seed(7919 * dist.get_rank() + self.data.step)
        tokens = torch.randint(
            0, self.args.vocab, (self.args.batch, self.args.seq + 1), generator=g
        )
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.data.step += 1


def fingerprint(job: Job) -> str:
    """crc32c of every byte of this rank's state, in a fixed order, with names and shapes."""
    crc = 0

    def add(name: str, value: Any) -> None:
        nonlocal crc
        if isinstance(value, torch.Tensor):
            t = value.detach().contiguous()
            crc = crc32c.crc32c(f"{name}:{t.dtype}:{list(t.shape)}".encode(), crc)
            crc = crc32c.crc32c(t.reshape(-1).view(torch.uint8).numpy(), crc)
        else:
            crc = crc32c.crc32c(f"{name}={value!r}".encode(), crc)

    for key, value in job.model.state_dict().items():
        add(f"model/{key}", value)
    optim = job.optimizer.state_dict()
    for index, state in sorted(optim["state"].items()):
        for key, value in sorted(state.items()):
            add(f"optimizer/{index}/{key}", value)
    add(
        "param_groups",
        [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]],
    )
    add("scheduler", sorted(job.scheduler.state_dict().items()))
    add("rng", torch.get_rng_state())
    add("data", job.data.step)
    return f"{crc:08x}"


def s3_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": args.s3_endpoint, "region_name": "us-east-1"},
    }


# --- pcframe -----------------------------------------------------------------------------------


def open_pcframe(job: Job, args: argparse.Namespace, config: str, root: Path, budget: int) -> Any:
    from pcframe.distributed import DistributedCheckpointer

    options: dict[str, Any] = {"replicas": 1 if config == "peers" else 0}
    if config == "peers":
        options.update(peer_dir=args.shm / f"{NODE}-shm", peer_budget=budget)
    if config in ("remote", "local", "peers") and args.s3_url:
        options["tiers"] = {"remote": {"url": args.s3_url, "storage_options": s3_options(args)}}
    return DistributedCheckpointer(
        root,
        model=job.model,
        optimizer=job.optimizer,
        scheduler=job.scheduler,
        data=job.data,
        keep_last=args.keep_last,
        **options,
    )


def pcframe_restore(ckpt: Any, log: Log) -> int:
    from pcframe.distributed import global_versions as rec
    from pcframe.errors import NoValidCheckpoint

    PHASES.clear()
    PHASES_CPU.clear()
    S3_READ[0] = 0
    log.stamp("restore_begin")
    try:
        start = ckpt.restore() or 0
    except NoValidCheckpoint as exc:  # records exist, but no version is whole anywhere
        log.stamp("restore_end")
        log.data["restore"] = {"step": 0, "phases": dict(PHASES), "error": str(exc)}
        log.data["restore"]["s3_read_bytes"] = S3_READ[0]
        return 0
    log.stamp("restore_end")
    report = ckpt.last_restore
    record = next((r for r in RECORDS if r.version == report.version), None)
    sizes = {s.rank: s.nbytes for s in record.shards} if record is not None else {}
    by_kind: dict[str, int] = {}
    for src, kind in report.shard_sources.items():
        by_kind[kind] = by_kind.get(kind, 0) + sizes.get(src, 0)
    log.data["restore"] = {
        "version": report.version,
        "step": start,
        "seconds": report.seconds,
        "fetch_seconds": report.fetch_seconds,
        "phases": dict(PHASES),
        "phases_cpu": dict(PHASES_CPU),
        "shard_sources": {str(k): v for k, v in report.shard_sources.items()},
        "shard_bytes": {str(k): v for k, v in sizes.items()},
        "bytes_by_source": by_kind,
        "peer_bytes": report.peer_bytes,
        "remote_bytes": report.remote_bytes,
        "s3_read_bytes": S3_READ[0],
        "skipped": [list(s) for s in report.skipped],
        "lost": [list(s) for s in report.lost],
        "records_seen": [r.version for r in RECORDS],
    }
    del rec
    return start


# --- DCP ---------------------------------------------------------------------------------------


class Dcp:
    """``dcp.async_save`` through FsspecWriter to ``<url>/step-<n>``; restore the newest with
    a ``.metadata`` (written last, by the coordinator, once every rank's data is there)."""

    def __init__(self, job: Job, args: argparse.Namespace) -> None:
        from fsspec.core import url_to_fs

        self.job, self.args = job, args
        self.url = args.s3_url.rstrip("/")
        self.options = s3_options(args)
        self.group = dist.new_group(backend="gloo")  # DCP's collectives, off the DDP group
        self.fs, self.root = url_to_fs(self.url, **self.options)
        self.future: Any = None
        self.done: list[int] = []
        self.pending_step = 0

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.job.model, self.job.optimizer)
        rank = dist.get_rank()
        per_rank = {"rng": torch.get_rng_state(), "step": torch.tensor(self.job.data.step)}
        return {
            "model": model,
            "optim": optim,
            "scheduler": self.job.scheduler.state_dict(),
            f"rank{rank}": per_rank,
        }

    def poll(self) -> None:
        if self.future is not None and self.future.done():
            self.future.result()
            self.done.append(self.pending_step)
            self.future = None

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        if self.future is not None:  # one save in flight: wait for the previous one
            self.future.result()
            self.done.append(self.pending_step)
        writer = FsspecWriter(f"{self.url}/step-{step:08d}", **self.options)
        self.future = dcp.async_save(self.state(), storage_writer=writer, process_group=self.group)
        self.pending_step = step

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.done.append(self.pending_step)
            self.future = None

    def newest(self) -> int:
        """The newest complete checkpoint's step (rank 0 lists, everyone learns it)."""
        found = [0]
        if dist.get_rank() == 0:
            with contextlib.suppress(FileNotFoundError):
                self.fs.invalidate_cache()
                names = self.fs.ls(self.root, detail=False)
                steps = sorted(
                    (int(n.rstrip("/").rsplit("-", 1)[-1]) for n in names if "/step-" in n),
                    reverse=True,
                )
                for step in steps:
                    if self.fs.exists(f"{self.root}/step-{step:08d}/.metadata"):
                        found = [step]
                        break
        dist.broadcast_object_list(found, src=0)
        return found[0]

    def restore(self, log: Log) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        from torch.distributed.checkpoint.state_dict import set_state_dict

        S3_READ[0] = 0
        log.stamp("restore_begin")
        t0 = time.perf_counter()
        step = self.newest()
        t1 = time.perf_counter()
        if step == 0:
            log.stamp("restore_end")
            log.data["restore"] = {"step": 0, "phases": {"records": t1 - t0}}
            return 0
        state = self.state()  # templates (the optimizer's state is created here)
        t2 = time.perf_counter()
        reader = FsspecReader(f"{self.url}/step-{step:08d}", **self.options)
        dcp.load(state, storage_reader=reader, process_group=self.group)
        t3 = time.perf_counter()
        set_state_dict(
            self.job.model,
            self.job.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.job.scheduler.load_state_dict(state["scheduler"])
        mine = state[f"rank{dist.get_rank()}"]
        torch.set_rng_state(mine["rng"])
        self.job.data.step = int(mine["step"])
        t4 = time.perf_counter()
        log.stamp("restore_end")
        log.data["restore"] = {
            "step": step,
            "seconds": t4 - t0,
            "phases": {
                "records": t1 - t0,
                "templates": t2 - t1,
                "fetch": t3 - t2,
                "apply": t4 - t3,
            },
            "s3_read_bytes": S3_READ[0],
            "remote_bytes": S3_READ[0],
        }
        return step


# --- the runs ----------------------------------------------------------------------------------


def budget_for(job: Job, args: argparse.Namespace) -> int:
    if args.peer_budget:
        return args.peer_budget
    return math.ceil(2.5 * job.state_bytes / dist.get_world_size())


def note_progress(ckpt: Any, saves: dict[str, dict[str, Any]], log: Log, now: float) -> None:
    """When (to a step) each version this rank saved became global, reached the peers
    (this rank's shard), and reached the object store (this rank's shard)."""
    log.data["globals"] = ckpt.global_versions()
    for version in log.data["globals"]:
        saves.get(str(version), {}).setdefault("t_global", now)
    if ckpt.peers is not None:
        log.data["copied"] = list(ckpt.peers.status.copied)
        for version in log.data["copied"]:
            saves.get(str(version), {}).setdefault("t_copied", now)
    tiers = getattr(ckpt.local, "tiers", None)
    if tiers is not None:
        remote = tiers.status().get("remote")
        if remote is not None:
            log.data["remote_status"] = {
                k: getattr(remote, k)
                for k in ("last_written", "pending", "in_flight", "written", "skipped",
                          "abandoned", "failures", "last_error", "bytes_written")
            }  # fmt: skip
        if remote is not None and remote.last_written:
            log.data["remote_written"] = remote.last_written
            saves.get(str(remote.last_written), {}).setdefault("t_remote", now)


def killed_run(args: argparse.Namespace, job: Job, log: Log) -> None:
    """Train with checkpoints until the driver kills node b; once restarted, restore and train
    ``--after`` steps."""
    config = args.config
    budget = budget_for(job, args)
    log.data.update(state_bytes=job.state_bytes, params=job.params, peer_budget=budget)
    sampler = None
    if config == "peers":
        sampler = ShmSampler(args.shm / f"{NODE}-shm" / f"kept-by-rank-{RANK}", log)
        sampler.start()
    ckpt: Any = None
    dcp_ckpt: Dcp | None = None
    if config in ("remote", "local", "peers"):
        time_restore_phases()
        root = args.work / (f"{NODE}-inc{INCARNATION}" if config == "remote" else NODE)
        ckpt = open_pcframe(job, args, config, root, budget)
    elif config == "empty" and INCARNATION > 0:  # the first one saves nothing: all is empty
        time_restore_phases()
        ckpt = open_pcframe(job, args, "peers", args.work / NODE, budget)
    elif config == "dcp":
        dcp_ckpt = Dcp(job, args)
    log.stamp("opened")
    start = 0
    if ckpt is not None:
        start = pcframe_restore(ckpt, log)
    elif dcp_ckpt is not None:
        start = dcp_ckpt.restore(log)
    else:
        log.stamp("restore_begin")
        log.stamp("restore_end")
    log.data["restored_step"] = start
    # What the restore fetched into this node's memory (kept after it: outside peer_budget).
    log.data["fetched_bytes"] = folder_bytes(args.shm / f"{NODE}-shm" / "fetched")
    fp_seconds = 0.0
    if INCARNATION > 0 and start and not args.no_fingerprint:
        t = time.perf_counter()
        log.data["restored_fingerprint"] = fingerprint(job)
        fp_seconds = time.perf_counter() - t
    log.data["fingerprint_seconds"] = fp_seconds
    log.stamp("train_begin")
    log.write()
    last = args.steps if INCARNATION == 0 else start + args.after
    saves: dict[str, dict[str, Any]] = log.data.setdefault("saves", {})
    step_times: list[float] = log.data.setdefault("step_times", [])
    for step in range(start + 1, last + 1):
        job.step()
        if step == start + 1:
            log.stamp("first_step")
        if step % args.every == 0 and INCARNATION == 0:
            if ckpt is not None:
                handle = ckpt.save(step)
                saves[str(handle.version)] = {"step": step, "t_save": time.time()}
            elif dcp_ckpt is not None:
                dcp_ckpt.save(step)
                saves[str(step)] = {"step": step, "t_save": time.time()}
            if config not in ("floor", "empty") and not args.no_fingerprint:
                log.data["fingerprints"][str(step)] = fingerprint(job)
        now = time.time()
        step_times.append(now)
        if dcp_ckpt is not None:
            dcp_ckpt.poll()
            log.data["dcp_done"] = list(dcp_ckpt.done)
            for done in dcp_ckpt.done:
                saves.get(str(done), {}).setdefault("t_durable", now)
        if ckpt is not None:
            note_progress(ckpt, saves, log, now)
        log.data["step"] = step
        log.write()
    log.stamp("trained")
    if ckpt is not None:
        ckpt.close()
        if ckpt.peers is not None:
            status = ckpt.peers.status
            log.data["peer_status"] = {
                "copied": list(status.copied),
                "sent_bytes": status.sent_bytes,
                "received_bytes": status.received_bytes,
                "declined": status.declined,
                "broken": status.broken,
            }
    if dcp_ckpt is not None:
        dcp_ckpt.wait()
    if sampler is not None:
        sampler.stop.set()
    log.stamp("closed")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, summed by thread name (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    by_name: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            name = python_names.get(int(tid)) or stat[stat.index("(") + 1 : stat.rindex(")")]
            name = name.rstrip("0123456789_-")  # pools: one name per kind of thread
            fields = stat[stat.rindex(")") + 2 :].split()
            by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return by_name


def overhead_run(args: argparse.Namespace, job: Job, log: Log) -> None:
    """Alternating timed phases with local-only and with peer-replicated checkpoints."""
    from pcframe.distributed import DistributedCheckpointer

    budget = budget_for(job, args)
    variants = [v for v in args.variants.split(",") if v]
    log.data.update(state_bytes=job.state_bytes, params=job.params, peer_budget=budget)
    log.data["phases"] = []
    sampler = ShmSampler(args.shm / f"{NODE}-shm-overhead" / f"kept-by-rank-{RANK}", log)
    sampler.start()
    # Warm up (DDP's first iterations, page cache of the first versions), untimed.
    for _ in range(2):
        job.step()
    for rep in range(args.reps):
        order = variants if rep % 2 == 0 else variants[::-1]
        for variant in order:
            ckpt = None
            if variant != "none":
                replicas = 1 if variant == "peers" else 0
                # Each rep reopens the variant's folder, which holds the earlier reps' versions,
                # and saves without restoring (a restore would change the timed phase): they
                # are this benchmark's own to prune.
                extra: dict[str, Any] = {"replicas": replicas, "take_over": True}
                if replicas:
                    extra.update(peer_dir=args.shm / f"{NODE}-shm-overhead", peer_budget=budget)
                ckpt = DistributedCheckpointer(
                    args.work / f"overhead-{variant}" / NODE,
                    model=job.model,
                    optimizer=job.optimizer,
                    scheduler=job.scheduler,
                    data=job.data,
                    keep_last=args.keep_last,
                    **extra,
                )
            dist.barrier()
            t0, cpu0, threads0 = time.perf_counter(), os.times(), thread_cpu()
            steps = []
            for i in range(1, args.phase_steps + 1):
                s0 = time.perf_counter()
                job.step()
                # A save every `every` steps, none on the last steps of the phase: each save
                # has `every` training steps after it inside the timed phase.
                if ckpt is not None and i % args.every == 0 and i + args.every <= args.phase_steps:
                    ckpt.save(job.data.step)
                steps.append(time.perf_counter() - s0)
            dist.barrier()
            t1, threads1 = time.perf_counter(), thread_cpu()
            copied = 0
            if ckpt is not None:
                ckpt.close()
                copied = ckpt.peers.status.copied_count if ckpt.peers is not None else 0
            t2, cpu2 = time.perf_counter(), os.times()
            log.data["phases"].append(
                {
                    "rep": rep,
                    "variant": variant,
                    "seconds": t1 - t0,
                    "close_seconds": t2 - t1,
                    # This process's CPU time over the phase and its close (all threads):
                    # what the copies cost, whatever else runs on the machine.
                    "cpu_seconds": (cpu2.user - cpu0.user) + (cpu2.system - cpu0.system),
                    # ... by thread name, the phase without its close (the engine's threads end
                    # in the close)
                    "cpu_by_thread": {
                        name: round(seconds - threads0.get(name, 0.0), 3)
                        for name, seconds in threads1.items()
                        if seconds - threads0.get(name, 0.0) > 0.005
                    },
                    "steps": steps,
                    "copied": copied,
                }
            )
            log.write()
    sampler.stop.set()


def main() -> None:
    args = ARGS
    torch.set_num_threads(1)
    # (No torch.use_deterministic_algorithms: it costs 1-3 s at start here, and the check is
    # of the restored state against the saved one, which needs no deterministic kernels.)
    args.control.mkdir(parents=True, exist_ok=True)
    log = Log(args.control)
    try:
        if args.s3_url:
            count_s3_reads()
        dist.init_process_group("gloo")
        log.stamp("init")
        job = Job(args)
        log.stamp("built")
        if args.config == "overhead":
            overhead_run(args, job, log)
        else:
            killed_run(args, job, log)
    except BaseException as exc:
        log.data["error"] = "".join(traceback.format_exception(exc))[-4000:]
        log.write()
        raise
    log.write()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
