"""``dcp.save`` through pcframe's StorageWriter vs DCP's FileSystemWriter: time to durable.

    python experiments/integrations/bench_dcp_storage.py \
        --mib 512 --repeats 5 --out experiments/results/integrations_dcp.md

Same process, same state (float32 tensors of a transformer-like spread of sizes), saved in
rotating order each round so drift on a shared machine hits every writer alike. Each timed
``dcp.save`` returns only when the checkpoint is durable: FileSystemWriter with
``sync_files=True`` (its default: fsync of every data file), pcframe after fdatasync of the
data, fsync of the manifest, the version directory, the root and LATEST. Every save writes
new files (fresh FileSystemWriter directories, new pcframe versions with keep_last=2), and
each round's FileSystemWriter directories are removed after the round, outside the timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from pcframe.integrations.dcp import StorageWriter

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def make_state(mib: int) -> dict[str, torch.Tensor]:
    """About ``mib`` MiB of float32 tensors: big matrices plus many small vectors."""
    torch.manual_seed(0)
    state, total, i = {}, mib << 20, 0
    while total > 0:
        rows = 1024 if i % 4 else 64  # 4 MiB matrices with a small one in between
        numel = min(rows * 1024, total // 4)
        state[f"layer{i}.weight"] = torch.randn(numel)
        state[f"layer{i}.bias"] = torch.randn(256)
        total -= numel * 4 + 1024
        i += 1
    return state


def writers(base: Path, round_: int) -> dict[str, Callable[[], object]]:
    return {
        "FileSystemWriter (1 thread, default)": lambda: dcp.FileSystemWriter(
            base / f"fs1-{round_}", sync_files=True
        ),
        "FileSystemWriter (4 threads)": lambda: dcp.FileSystemWriter(
            base / f"fs4-{round_}", sync_files=True, thread_count=4
        ),
        "pcframe StorageWriter (4 writer threads)": lambda: StorageWriter(
            base / "pcframe", keep_last=2
        ),
        # The same without per-chunk checksums: what the checksums cost (FileSystemWriter
        # stores none).
        "pcframe StorageWriter (checksum=none)": lambda: StorageWriter(
            base / "pcframe-nosum", keep_last=2, checksum="none"
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--out", default="experiments/results/integrations_dcp.md")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir))
    state = make_state(args.mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    times: dict[str, list[float]] = {}
    try:
        for round_ in range(args.repeats + 1):  # round 0 warms up (page cache, allocator)
            made = writers(base, round_)
            names = list(made)
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                writer = made[name]()
                start = time.perf_counter()
                dcp.save(state, storage_writer=writer)  # type: ignore[arg-type]
                elapsed = time.perf_counter() - start
                if round_:
                    times.setdefault(name, []).append(elapsed)
            for old in base.glob(f"fs*-{round_}"):
                shutil.rmtree(old)
            print(
                f"round {round_}: " + ", ".join(f"{n}: {times.get(n, [0])[-1]:.2f}s" for n in names)
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(args, nbytes, times)


def report(args: argparse.Namespace, nbytes: int, times: dict[str, list[float]]) -> None:
    reference = statistics.median(times["FileSystemWriter (1 thread, default)"])
    command = "python experiments/integrations/bench_dcp_storage.py " + " ".join(sys.argv[1:])
    title = "dcp.save: pcframe StorageWriter vs FileSystemWriter (time to durable)"
    lines = [
        *header(title, command),
        f"{nbytes / 2**20:.0f} MiB of float32 state ({args.repeats} timed rounds after one "
        f"warm-up, writers in rotating order), one process, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}), files on "
        f"{_filesystem(args.dir or tempfile.gettempdir())}. Both durable on return: "
        "FileSystemWriter(sync_files=True) fsyncs each file; pcframe fdatasyncs data.bin, "
        "fsyncs manifest, directories and LATEST. The machine is shared with other jobs: "
        "read the spread.",
        "",
    ]
    order = list(writers(Path("."), 0))  # the same row order in every report
    times = {name: times[name] for name in order}
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        rows.append(
            [
                name,
                f"{median:.3f}",
                f"{min(values):.3f}",
                f"{max(values):.3f}",
                f"{max(values) / min(values):.2f}x",
                f"{nbytes / 2**30 / median:.2f}",
                f"{median / reference:.2f}x",
            ]
        )
    columns = ["writer", "median (s)", "min (s)", "max (s)", "spread (max/min)"]
    columns += ["GiB/s (median)", "time / FileSystemWriter default"]
    lines += table_lines(columns, rows, align="lrrrrrr")
    lines += ["", "Every round (s):", ""]
    lines += [
        f"- {name}: " + ", ".join(f"{v:.3f}" for v in values) for name, values in times.items()
    ]
    write_results(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


def _filesystem(path: str) -> str:
    """The mount's type and device for ``path`` (from /proc/mounts), e.g. 'ext4 /dev/vda'."""
    try:
        best = ("", "?", "?")
        real = os.path.realpath(path)
        for line in Path("/proc/mounts").read_text().splitlines():
            device, point, kind = line.split()[:3]
            if real.startswith(point) and len(point) > len(best[0]):
                best = (point, kind, device)
        return f"{best[1]} ({best[2]})"
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
