"""Two ranks, one DDP job: pcframe's DistributedCheckpointer vs torch.distributed.checkpoint.

Every method saves the same state (DDP-replicated model + Adam, each tensor written once
across the two ranks) in the same run, in rotating order, several times. Per save:

* **stall**: seconds the training thread is blocked. pcframe: its ``save()`` plus any wait of
  the next ``optimizer.step()`` for the snapshot copy (``DistributedCheckpointer.stall``);
  ``dcp.save``: the whole call; ``dcp.async_save``: the call (staging a copy of the state).
* **overlap cost**: extra seconds of the training steps that run while the checkpoint is
  persisted in the background (both ranks share 2 CPU cores with the writers): those steps
  minus the same steps in the checkpoint-free slot of the same round.
* **time to durable**: from the call until every rank's data is fsynced and the checkpoint is
  complete (pcframe: the global version is published; dcp: the call / future returns).
* **aggregate write bandwidth**: bytes on disk of the checkpoint (both ranks) / time to durable.

Ranks are reported by the slower one (a DDP job waits for it). Usage::

    python experiments/distributed/bench_distributed.py --out experiments/results/distributed_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

METHODS = ["pcframe", "dcp.save", "dcp.async_save"]
BASELINE = "none"  # the same training steps without a checkpoint, in the same rotation


@dataclass
class Sample:
    method: str
    stall: float
    overlap: float
    durable: float
    nbytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Job:
    def __init__(self, layers: int, width: int, batch: int) -> None:
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.model = DistributedDataParallel(net)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.batch, self.width = batch, width
        torch.manual_seed(1 + dist.get_rank())

    def step(self) -> float:
        start = time.perf_counter()
        loss = self.model(torch.randn(self.batch, self.width)).pow(2).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return time.perf_counter() - start

    def state_bytes(self) -> int:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return 3 * params  # weights + Adam's two moments


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Pcframe:
    def __init__(self, root: Path, job: Job) -> None:
        from pcframe.distributed import DistributedCheckpointer

        # take_over: a --root given again holds an earlier run's versions, this benchmark's
        # scratch to replace (it saves without restoring: a restore is not what it times).
        self.ckpt = DistributedCheckpointer(
            root / "pcframe", model=job.model, optimizer=job.optimizer, keep_last=2, take_over=True
        )
        self.root = root / "pcframe"
        self.versions: list[int] = []

    def save(self, step: int) -> Any:
        handle = self.ckpt.save(step)
        self.versions.append(handle.version)
        return handle

    def durable(self, handle: Any) -> float:
        handle.wait()  # raises SaveError if the version did not become global
        return self.ckpt.rounds[handle.version].decided_at

    def nbytes(self, handle: Any) -> int:
        # This rank's shard only; the ranks' numbers are summed.
        rank_dir = self.root / f"rank-{dist.get_rank()}" / f"v{handle.version:08d}"
        return tree_bytes(rank_dir)

    def close(self) -> list[float]:
        self.ckpt.close()  # reports the engine's per-version stall
        return [self.ckpt.stall(v) or 0.0 for v in self.versions]


class NoCheckpoint:
    def save(self, step: int) -> Any:
        return None

    def durable(self, handle: Any) -> float:
        return time.perf_counter()

    def nbytes(self, handle: Any) -> int:
        return 0

    def close(self) -> list[float]:
        return []


class Dcp:
    def __init__(self, root: Path, job: Job, asynchronous: bool) -> None:
        self.root, self.job, self.asynchronous = root / "dcp", job, asynchronous
        # async_save runs its collectives in a background thread: DCP asks for a separate
        # gloo group so they cannot interleave with the job's own collectives.
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self.previous: Path | None = None

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.job.model, self.job.optimizer)
        return {"model": model_state, "optim": optim_state}

    def save(self, step: int) -> Any:
        import torch.distributed.checkpoint as dcp

        path = self.root / f"{'async' if self.asynchronous else 'sync'}-{step}"
        done: list[float] = []
        if self.asynchronous:
            future = dcp.async_save(self.state(), checkpoint_id=path, process_group=self.group)
            future.add_done_callback(lambda _: done.append(time.perf_counter()))
            return (path, future, done)
        dcp.save(self.state(), checkpoint_id=path)
        done.append(time.perf_counter())
        return (path, None, done)

    def durable(self, handle: Any) -> float:
        _, future, done = handle
        if future is not None:
            future.result()
        while not done:  # the callback runs right after result() is set
            time.sleep(0.001)
        return done[0]

    def nbytes(self, handle: Any) -> int:
        path = handle[0]
        # One rank counts the shared directory; drop the previous one to bound disk use.
        total = tree_bytes(path) if dist.get_rank() == 0 else 0
        dist.barrier()
        if dist.get_rank() == 0 and self.previous is not None:
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous = path
        return total

    def close(self) -> list[float]:
        return []


def run_rank(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    job = Job(args.layers, args.width, args.batch)
    for _ in range(2):
        job.step()  # creates Adam's state
    root = Path(args.root)
    methods = {
        BASELINE: NoCheckpoint(),
        "pcframe": Pcframe(root, job),
        "dcp.save": Dcp(root, job, asynchronous=False),
        "dcp.async_save": Dcp(root, job, asynchronous=True),
    }
    names = [BASELINE, *METHODS]
    samples: list[Sample] = []
    for rep in range(args.reps + 1):  # the first round warms up (buffers, plans) unrecorded
        order = names[rep % 4 :] + names[: rep % 4]  # rotate: no method always goes first
        for name in order:
            method = methods[name]
            job.step()
            start = time.perf_counter()
            handle = method.save(rep)
            call = time.perf_counter() - start
            window = [job.step() for _ in range(args.steps_between)]
            durable = method.durable(handle) - start
            nbytes = method.nbytes(handle)
            if rep > 0:
                samples.append(Sample(name, call, sum(window), durable, nbytes))
            dist.barrier()
    # Overlap cost: the window's extra time over the checkpoint-free window of the same round.
    for i in range(0, len(samples), 4):
        group = samples[i : i + 4]
        free = next(s.overlap for s in group if s.method == BASELINE)
        for sample in group:
            sample.extra["window"] = sample.overlap
            sample.overlap -= free
    samples = [s for s in samples if s.method != BASELINE]
    if args.reps:
        ours = [s for s in samples if s.method == "pcframe"]
        stalls = methods["pcframe"].close()[-len(ours) :]
        for sample, stall in zip(ours, stalls, strict=True):
            sample.extra["call"], sample.stall = sample.stall, stall
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, [vars(s) for s in samples], group=None)
    if rank == 0:
        payload = {
            "samples": gathered,
            "state_bytes": job.state_bytes(),
            "torch": torch.__version__,
        }
        Path(args.root, "results.json").write_text(json.dumps(payload))
    dist.barrier()
    dist.destroy_process_group()


def summarize(payload: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    per_rank = payload["samples"]
    rows = {}
    for name in METHODS:
        reps = [[s for s in rank if s["method"] == name] for rank in per_rank]
        # Per save: the slower rank's stall/durable; bytes summed over ranks.
        stall = [max(r[i]["stall"] for r in reps) for i in range(len(reps[0]))]
        overlap = [max(r[i]["overlap"] for r in reps) for i in range(len(reps[0]))]
        durable = [max(r[i]["durable"] for r in reps) for i in range(len(reps[0]))]
        nbytes = [sum(r[i]["nbytes"] for r in reps) for i in range(len(reps[0]))]
        bandwidth = [b / d / 1e6 for b, d in zip(nbytes, durable, strict=True)]
        rows[name] = {
            "stall": statistics.median(stall),
            "overlap": statistics.median(overlap),
            "durable": statistics.median(durable),
            "mb": statistics.median(nbytes) / 1e6,
            "bw": statistics.median(bandwidth),
            "raw_stall": stall,
            "raw_durable": durable,
        }
    ref = rows["pcframe"]
    title = "Distributed checkpointing on CPU: pcframe vs torch.distributed.checkpoint"
    lines = [
        *header(title, command),
        f"2 ranks (gloo, 1 torch thread each) on a {os.cpu_count()}-core machine shared with "
        f"other jobs, torch {payload['torch']}, ext4 on a virtual disk. Model: DDP, "
        f"{args.layers} x Linear({args.width}, {args.width}) + Adam = "
        f"{payload['state_bytes'] / 1e6:.0f} MB of state, replicated on both ranks and written "
        f"once (both methods deduplicate replicated tensors). {args.reps} saves per method in "
        f"rotating order with a checkpoint-free round, after one warm-up round; "
        f"{args.steps_between} training steps after each save. Medians; per save the slower "
        "rank counts. pcframe: default engine config (2 in flight, 4 writer threads, 16 MiB "
        "chunks, crc32c); dcp: FileSystemWriter defaults (1 thread, fsync on).",
        "",
    ]
    cells = []
    for name in METHODS:
        row = rows[name]
        cells.append(
            [
                name,
                f"{row['stall']:.3f}",
                f"{row['overlap']:.3f}",
                f"{row['durable']:.2f}",
                f"{row['mb']:.0f}",
                f"{row['bw']:.0f}",
                f"{row['stall'] / ref['stall']:.1f}x",
                f"{row['bw'] / ref['bw']:.2f}x",
            ]
        )
    columns = ["method", "stall / save (s)", "overlap cost (s)", "time to durable (s)"]
    columns += ["written (MB)", "aggregate write bandwidth (MB/s)", "stall / pcframe"]
    columns += ["bandwidth / pcframe"]
    lines += table_lines(columns, cells, align="lrrrrrrr")
    lines += ["", "Per save (stall s / time to durable s):", ""]
    for name in METHODS:
        row = rows[name]
        pairs = ", ".join(
            f"{s:.3f}/{d:.2f}" for s, d in zip(row["raw_stall"], row["raw_durable"], strict=True)
        )
        lines.append(f"- {name}: {pairs}")
    lines += [
        "",
        "Columns: *stall* = training thread blocked (pcframe: `save()` plus the next "
        "`optimizer.step()` waiting for the snapshot copy; dcp: the call, including "
        "`get_state_dict`); *overlap cost* = extra time of the training steps that ran while "
        "the checkpoint was persisted, against the checkpoint-free slot of the same round "
        "(noisy on this shared machine: differences under about 0.5 s, and negative values, "
        "are noise); *time to durable* = until every "
        "rank's data is fsynced and the checkpoint is complete (pcframe: global version "
        "published); *bandwidth* = bytes on disk of both ranks / time to durable. Ratios "
        "divide by the pcframe row (a tiny pcframe stall makes the stall ratio large).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps-between", type=int, default=3)
    parser.add_argument("--root", help="scratch directory (default: a new temporary one)")
    parser.add_argument("--out", help="write the Markdown table here (else print it)")
    args = parser.parse_args()
    scratch = args.root is None
    args.root = args.root or tempfile.mkdtemp(prefix="pcframe-bench-dist-")
    command = "python " + " ".join(
        [Path(sys.argv[0]).as_posix(), *[a for a in sys.argv[1:] if not a.startswith("--root")]]
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"OMP_NUM_THREADS": "1"}
    os.environ.update(env)
    try:
        mp.spawn(run_rank, args=(2, args, port), nprocs=2, join=True)
        payload = json.loads(Path(args.root, "results.json").read_text())
    finally:
        if scratch:
            shutil.rmtree(args.root, ignore_errors=True)
    table = summarize(payload, args, command)
    if args.out:
        write_results(args.out, table)
    print(table)


if __name__ == "__main__":
    main()
