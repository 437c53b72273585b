"""Tier benchmark: time to durable per tier, and remote upload throughput and lag.

Configurations (the same state, ``--size-mb`` MiB of float32 weights, no optimizer):

* ``disk``: the Checkpointer's directory on the local disk.
* ``memory``: the directory on /dev/shm (tmpfs): a commit is a memory copy.
* ``memory+disk``: memory primary plus a disk replica copied in the background
  (``MemoryThenDisk(disk_every=1)``): time to durable in memory, and until the disk has it.
* ``disk+s3``: local disk plus an ``s3://`` tier on a moto server started on loopback
  (``LocalPlusRemote(remote_every=1)``): upload seconds and throughput per version, then a
  burst of saves faster than the uploads can follow, to show the lag and the skipped versions.

Run:  python experiments/tiers/bench_tiers.py --size-mb 128 --out experiments/results/tiers_cpu.md
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import torch

import pcframe.policies as P
from pcframe import Checkpointer
from pcframe.store.tiers import RemoteTier, Tiers

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

MiB = 1024 * 1024


def build_model(size_mb: int) -> torch.nn.Module:
    side = 2048  # 16 MiB per layer
    layers = max(1, round(size_mb * MiB / (side * side * 4)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])


def perturb(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(value)


def nbytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def raw_write_seconds(directory: Path, size: int, repeats: int) -> float:
    """Median seconds to write ``size`` bytes in 8 MiB blocks and fsync: the storage alone."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(8 * MiB)
    times = []
    for _ in range(repeats):
        path = directory / "raw.bin"
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(-(-size // len(block))):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
        times.append(time.perf_counter() - start)
        path.unlink()
    return median(times)


def time_primary(directory: Path, model: torch.nn.Module, repeats: int, **kw) -> dict:
    """Seconds from save() to committed in the primary tier (plus replica times if any)."""
    durable, replica = [], []
    shutil.rmtree(directory, ignore_errors=True)
    with Checkpointer(directory, model=model, keep_last=2, **kw) as ckpt:
        for i in range(repeats + 1):  # the first save builds the layout and staging: not timed
            perturb(model, 1e-3)
            start = time.perf_counter()
            ckpt.save(i + 1).wait()
            committed = time.perf_counter()
            if ckpt.tiers is not None:
                assert ckpt.tiers.wait_idle(600)
            done = time.perf_counter()
            if i:
                durable.append(committed - start)
                replica.append(done - start)
    shutil.rmtree(directory, ignore_errors=True)
    return {"durable": durable, "replica": replica}


class Moto:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(1200):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/moto-api/", timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("moto server did not start")

    def options(self) -> dict:
        return {
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{self.port}"},
        }

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def bench_remote(local: Path, model: torch.nn.Module, repeats: int, burst: int, gap: float):
    moto = Moto()
    try:
        url = f"s3://bench-{uuid.uuid4().hex[:8]}/run"
        tier = RemoteTier(url, moto.options(), timeout=60)
        tiers = Tiers({"remote": tier}, backoff=0.1, drain_timeout=600)
        placement = P.LocalPlusRemote(remote_every=1, local_keep=3, remote_keep=2)
        shutil.rmtree(local, ignore_errors=True)
        uploads, local_durable = [], []
        with Checkpointer(local, model=model, tiers=tiers, placement=placement) as ckpt:
            for i in range(repeats + 1):
                perturb(model, 1e-3)
                start = time.perf_counter()
                ckpt.save(i + 1).wait()
                committed = time.perf_counter()
                assert ckpt.tiers.wait_idle(600)
                if i:
                    local_durable.append(committed - start)
                    uploads.append(time.perf_counter() - committed)
            before = ckpt.tiers.status()["remote"]
            # a burst of saves every `gap` seconds, faster than the uploads
            max_lag, max_lag_s, stalls = 0, 0.0, []
            for i in range(burst):
                perturb(model, 1e-3)
                start = time.perf_counter()
                ckpt.save(repeats + 2 + i).wait()
                stalls.append(time.perf_counter() - start)
                status = ckpt.tiers.status()["remote"]
                max_lag = max(max_lag, status.lag_versions)
                max_lag_s = max(max_lag_s, status.lag_seconds)
                time.sleep(gap)
            drained_from = time.perf_counter()
            assert ckpt.tiers.wait_idle(600)
            catch_up = time.perf_counter() - drained_from
            after = ckpt.tiers.status()["remote"]
            listed = tier.committed_versions()
        return {
            "uploads": uploads,
            "local_durable": local_durable,
            "throughput": nbytes(model) / median(uploads) / MiB,
            "burst": burst,
            "gap": gap,
            "burst_written": after.written - before.written,
            "burst_skipped": after.skipped - before.skipped,
            "max_lag_versions": max_lag,
            "max_lag_seconds": max_lag_s,
            "burst_local_durable": median(stalls),
            "catch_up": catch_up,
            "listed": listed,
        }
    finally:
        moto.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--burst", type=int, default=8, help="saves in the remote lag burst")
    parser.add_argument("--gap", type=float, default=0.2, help="seconds between burst saves")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir())
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]  # other work on the machine skews every number below
    model = build_model(args.size_mb)
    size = nbytes(model) / MiB
    tag = uuid.uuid4().hex[:8]
    disk = Path(args.disk_dir) / f"pcframe-bench-{tag}"
    shm = Path(args.shm_dir) / f"pcframe-bench-{tag}"
    rows = []
    raw = {}
    try:
        raw["disk"] = raw_write_seconds(disk / "raw", nbytes(model), args.repeats)
        raw["memory"] = raw_write_seconds(shm / "raw", nbytes(model), args.repeats)
        r = time_primary(disk / "primary", model, args.repeats)
        rows.append(("disk (O_DIRECT, engine default)", median(r["durable"]), None))
        r = time_primary(disk / "primary", model, args.repeats, o_direct="off")
        rows.append(("disk (buffered, o_direct=off)", median(r["durable"]), None))
        r = time_primary(shm / "primary", model, args.repeats)
        rows.append(("memory (/dev/shm)", median(r["durable"]), None))
        r = time_primary(
            shm / "primary",
            model,
            args.repeats,
            tiers={"local": disk / "replica"},
            placement=P.MemoryThenDisk(memory_keep=1, disk_keep=1, disk_every=1),
        )
        rows.append(("memory+disk", median(r["durable"]), median(r["replica"])))
        remote = bench_remote(disk / "remote-local", model, args.repeats, args.burst, args.gap)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    command = "python " + " ".join([sys.argv[0], *sys.argv[1:]])
    title = "Tiers on CPU: time to durable per tier, remote upload throughput and lag"
    lines = [
        *header(title, command),
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {load:.1f} at start, "
        f"Python {platform.python_version()}, torch {torch.__version__}; disk tier under "
        f"`{args.disk_dir}`, memory tier under `{args.shm_dir}`; remote = moto S3 server on "
        "loopback (in-memory, single process). State: "
        f"{size:.0f} MiB of float32 weights; medians of {args.repeats} saves (a warm-up save "
        "not counted).",
        "",
        f"Raw storage, {size:.0f} MiB written in 8 MiB blocks + fsync: disk "
        f"{raw['disk']:.3f} s ({size / raw['disk']:.0f} MiB/s), /dev/shm {raw['memory']:.3f} s "
        f"({size / raw['memory']:.0f} MiB/s).",
        "",
    ]
    cells = []
    for name, primary, replica in rows:
        rep = f"{replica:.3f}" if replica is not None else "–"
        cells.append([name, f"{primary:.3f}", rep, f"{size / primary:.0f}"])
    up, local = median(remote["uploads"]), median(remote["local_durable"])
    remote_row = [f"{local:.3f}", f"{local + up:.3f}", f"{size / local:.0f}"]
    cells.append(["disk+s3 (remote every version)", *remote_row])
    columns = ["configuration", "save → durable in primary (s)"]
    columns += ["save → durable in replica (s)", "MiB/s (primary)"]
    lines += table_lines(columns, cells)
    metrics = [
        ("upload after local commit, median (s)", f"{up:.3f}"),
        ("upload throughput (MiB/s)", f"{remote['throughput']:.1f}"),
        ("burst: saves, gap between saves (s)", f"{remote['burst']}, {remote['gap']}"),
        ("burst: local save → durable, median (s)", f"{remote['burst_local_durable']:.3f}"),
        (
            "burst: versions uploaded / skipped (newest wins)",
            f"{remote['burst_written']} / {remote['burst_skipped']}",
        ),
        (
            "burst: max lag (versions / seconds)",
            f"{remote['max_lag_versions']} / {remote['max_lag_seconds']:.2f}",
        ),
        ("burst: seconds to catch up after the last save", f"{remote['catch_up']:.2f}"),
        ("remote listing at the end (remote_keep=2)", f"{remote['listed']}"),
    ]
    lines += [
        "",
        "Remote tier (s3fs → moto on loopback):",
        "",
        *table_lines(["metric", "value"], metrics),
        "",
        "Reading the numbers: *save → durable* is from `save()` until the version is committed "
        "(data and manifest synced, renamed, LATEST written) in that tier; the replica column "
        "is until the background copy is committed in the second tier. The engine writes to "
        "disk with O_DIRECT straight from its staging buffers; tmpfs refuses O_DIRECT, so a "
        "memory-tier save pays one more memory copy (staging → page cache) and page "
        "allocation, like the buffered disk row. Where the disk takes fsynced writes as fast "
        "as this VM's (see the raw line), that costs more than it saves: the memory tier pays "
        "off when the disk is slower than a memory copy (e.g. network persistent disks at "
        "100–250 MiB/s), and for restarts of a crashed process on the same machine. During the "
        "burst the upload competes with the saves for the same two CPUs (moto and s3fs are "
        "CPU-bound on loopback), which shows in the local time to durable; the saves never "
        "wait for the upload itself.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_results(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
