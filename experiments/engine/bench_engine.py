"""Engine benchmark: pcframe vs torch.save, torch.distributed.checkpoint save / async_save.

The same state (a model + Adam moments, about ``--size-gb`` GiB on CPU) is checkpointed by
each method in its own fresh process (so peak memory is per method). Per method we report:

* blocking stall: seconds the training thread is blocked per checkpoint, in a loop that
  saves every ``--every`` steps with a GPU-like iteration (``--iteration-ms`` of idle CPU
  standing for forward/backward on an accelerator, then a real ``optimizer.step()``);
* time to durable: from the save call until the checkpoint is on disk and synced;
* write bandwidth: checkpoint bytes / time to durable, and its ratio to the raw sequential
  O_DIRECT write bandwidth of the same disk measured in the same run;
* peak extra host memory over the resident state;
* restore time (page cache dropped first when the kernel lets us).

Run:  python experiments/engine/bench_engine.py --size-gb 1 --out experiments/results/engine_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAGE = 4096


# --- helpers run inside each method's process ---------------------------------------------


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def build_state(size_gb: float):
    import torch

    torch.manual_seed(0)
    width = 4096
    per_layer = width * width + width
    layers = max(1, round(size_gb * (1 << 30) / 12 / per_layer))  # weights + 2 Adam moments
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # materialise the moments
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return model, optimizer, nbytes


def fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


class TorchSave:
    def __init__(self, model, optimizer, directory: Path):
        self.model, self.optimizer, self.dir, self.n = model, optimizer, directory, 0

    def save(self) -> float:
        import torch

        start = time.perf_counter()
        self.n += 1
        path = self.dir / f"ckpt{self.n}.pt"
        with open(path, "wb") as f:
            torch.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - start

    def restore(self) -> float:
        import torch

        path = self.dir / f"ckpt{self.n}.pt"
        start = time.perf_counter()
        state = torch.load(path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        return time.perf_counter() - start


class DCP:
    def __init__(self, model, optimizer, directory: Path, use_async: bool):
        self.model, self.optimizer, self.dir, self.n = model, optimizer, directory, 0
        self.use_async, self.future, self.started = use_async, None, 0.0
        self.durables: list[float] = []

    def state(self):
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def save(self) -> float:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        self._wait_previous()  # DCP allows one async save at a time: waiting is stall too
        self.n += 1
        path = str(self.dir / f"ckpt{self.n}")
        self.started = time.perf_counter()
        if self.use_async:
            self.future = dcp.async_save(self.state(), checkpoint_id=path)
        else:
            dcp.save(self.state(), checkpoint_id=path)
            self.durables.append(time.perf_counter() - self.started)
        return time.perf_counter() - start

    def _wait_previous(self) -> float:
        if self.future is None:
            return 0.0
        start = time.perf_counter()
        self.future.result()
        self.durables.append(time.perf_counter() - self.started)
        self.future = None
        return time.perf_counter() - start

    def restore(self) -> float:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        state = self.state()
        dcp.load(state, checkpoint_id=str(self.dir / f"ckpt{self.n}"))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        return time.perf_counter() - start


class PCFrame:
    def __init__(self, model, optimizer, directory: Path, **options):
        from pcframe import Checkpointer

        self.ckpt = Checkpointer(
            directory, model=model, optimizer=optimizer, keep_last=2, **options
        )
        self.model, self.optimizer, self.dir, self.step = model, optimizer, directory, 0

    def save(self) -> float:
        start = time.perf_counter()
        self.step += 1
        self.ckpt.save(self.step)
        return time.perf_counter() - start

    def restore(self) -> float:
        from pcframe import Checkpointer

        self.ckpt.close()
        start = time.perf_counter()
        with Checkpointer(self.dir, model=self.model, optimizer=self.optimizer) as ckpt:
            ckpt.restore()
        return time.perf_counter() - start


def run_method(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(2)
    model, optimizer, nbytes = build_state(args.size_gb)
    directory = Path(args.dir)
    method = args.method
    if method == "torch.save":
        impl = TorchSave(model, optimizer, directory)
    elif method in ("dcp.save", "dcp.async_save"):
        impl = DCP(model, optimizer, directory, use_async=method == "dcp.async_save")
    else:
        options = json.loads(args.options)
        impl = PCFrame(model, optimizer, directory, **options)
    optimizer.step()  # warm the step path
    baseline_rss = rss_bytes()
    reset_peak()
    stalls, durables = [], []
    iteration = args.iteration_ms / 1000
    steps = args.checkpoints * args.every
    for step in range(1, steps + 1):
        time.sleep(iteration)  # forward/backward on an accelerator: the CPU is free
        optimizer.step()  # pcframe's gate waits here; measured in its records' stall
        if step % args.every == 0:
            stalls.append(impl.save())
            if method == "torch.save":
                durables.append(stalls[-1])
    if method.startswith("dcp"):
        if impl.use_async:
            impl._wait_previous()
        durables = impl.durables
    elif method.startswith("pcframe"):
        impl.ckpt.wait()
        records = [r for r in impl.ckpt.records.values() if r.status == "committed"]
        stalls = [r.stall for r in records]
        durables = [r.durable for r in records]
    peak_extra = rss_bytes("VmHWM") - baseline_rss
    # A single cold restore of 1 GiB varies by 2x here (page zeroing, writeback of the last
    # checkpoint): take the median of several, each with the page cache dropped first.
    restores = []
    for _ in range(args.restores):
        cold = drop_caches()
        restores.append(impl.restore())
    restore = statistics.median(restores)
    return {
        "method": method if not method.startswith("pcframe") else f"pcframe {args.options}",
        "bytes": nbytes,
        "stall_s": statistics.median(stalls),
        "stall_max_s": max(stalls),
        "durable_s": statistics.median(durables),
        "peak_extra_bytes": peak_extra,
        "restore_s": restore,
        "cold_cache": cold,
    }


# --- the parent: raw disk bandwidth, one process per method, the table ----------------------


def raw_write_bandwidth(directory: Path, nbytes: int, chunk: int = 16 << 20) -> float:
    import mmap

    buffer = mmap.mmap(-1, chunk)
    buffer.write(os.urandom(chunk))
    path = directory / "raw.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    start = time.perf_counter()
    written = 0
    while written < nbytes:
        written += os.pwrite(fd, buffer, written)
    os.fsync(fd)
    seconds = time.perf_counter() - start
    os.close(fd)
    path.unlink()
    return written / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--iteration-ms", type=float, default=300.0)
    parser.add_argument("--restores", type=int, default=3, help="cold restores per method")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument("--out", default="experiments/results/engine_cpu.md")
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.method:
        Path(args.json).write_text(json.dumps(run_method(args)))
        return

    base = Path(args.dir or tempfile.mkdtemp(prefix="pcframe-bench-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    nbytes = int(args.size_gb * (1 << 30))
    methods = [
        ("torch.save", "{}"),
        ("dcp.save", "{}"),
        ("dcp.async_save", "{}"),
        ("pcframe", '{"max_in_flight": 1, "o_direct": "auto", "staging_ratio": 1.0}'),
        ("pcframe", '{"max_in_flight": 2, "o_direct": "auto", "staging_ratio": 1.0}'),
        ("pcframe", '{"max_in_flight": 4, "o_direct": "auto", "staging_ratio": 1.0}'),
        ("pcframe", '{"max_in_flight": 2, "o_direct": "off", "staging_ratio": 1.0}'),
        ("pcframe", '{"max_in_flight": 2, "o_direct": "auto", "staging_ratio": 2.0}'),
    ]
    raw = [raw_write_bandwidth(base, nbytes)]
    results = []
    for method, options in methods:
        directory = base / "run"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        out = base / "result.json"
        cmd = [
            sys.executable,
            __file__,
            "--method",
            method,
            "--options",
            options,
            "--json",
            str(out),
            "--dir",
            str(directory),
            "--size-gb",
            str(args.size_gb),
            "--checkpoints",
            str(args.checkpoints),
            "--every",
            str(args.every),
            "--restores",
            str(args.restores),
            "--iteration-ms",
            str(args.iteration_ms),
        ]
        subprocess.run(cmd, check=True)
        results.append(json.loads(out.read_text()))
        print(json.dumps(results[-1]), flush=True)
        raw.append(raw_write_bandwidth(base, nbytes))
    shutil.rmtree(base, ignore_errors=True)
    write_table(args, results, statistics.median(raw), raw)


def write_table(args, results, raw_bw, raw_all) -> None:
    by_name = {r["method"]: r for r in results}
    async_stall = by_name["dcp.async_save"]["stall_s"]
    dcp_restore = by_name["dcp.save"]["restore_s"]
    gib = 1 << 30
    lines = [
        "# Engine benchmark (CPU)",
        "",
        "Command: `python experiments/engine/bench_engine.py "
        f"--size-gb {args.size_gb} --checkpoints {args.checkpoints} --every {args.every} "
        f"--iteration-ms {args.iteration_ms:g} --out {args.out}`",
        "",
        f"State: {results[0]['bytes'] / gib:.2f} GiB (model + Adam moments, fp32, CPU). "
        f"Raw O_DIRECT sequential write of the same size, same disk, same run: "
        f"{raw_bw / 1e9:.2f} GB/s (median of {len(raw_all)}: "
        + ", ".join(f"{b / 1e9:.2f}" for b in raw_all)
        + "). "
        f"Restore = median of {args.restores} restores, each read with the page cache "
        f"{'dropped' if results[0]['cold_cache'] else 'warm'}.",
        "Stall = seconds the training thread is blocked per checkpoint (median), with a "
        f"{args.iteration_ms:g} ms idle-CPU iteration standing for accelerator compute and a "
        f"real Adam step; checkpoint every {args.every} steps.",
        "",
        "| method | stall (s) | stall / async_save | time to durable (s) | write GB/s | "
        "÷ raw disk | peak extra host mem (GiB) | restore (s) | restore ÷ dcp.load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        bandwidth = r["bytes"] / r["durable_s"]
        lines.append(
            f"| {r['method']} | {r['stall_s']:.3f} | {r['stall_s'] / async_stall:.2f} | "
            f"{r['durable_s']:.2f} | {bandwidth / 1e9:.2f} | {bandwidth / raw_bw:.2f} | "
            f"{r['peak_extra_bytes'] / gib:.2f} | {r['restore_s']:.2f} | "
            f"{r['restore_s'] / dcp_restore:.2f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
