"""Persist paths and copy backends of the engine, compared in one run.

Two tables, each with its own baseline, all measured in the same process on the same state
(``--mb`` MiB of fp32 tensors held by a stateful object, so ``save()`` returns when the copy
stage is done and its blocking time *is* the copy):

1. **Persist paths**: buffered ``pwrite`` vs O_DIRECT vs ``mmap`` (copy + checksum into a
   shared mapping, msync) on a disk directory, and ``pwrite`` vs ``mmap`` on ``/dev/shm``.
   Metric: time to durable (save call -> committed: data synced, manifest written,
   renamed) and its bandwidth; ratio to buffered ``pwrite`` on the same file system.
2. **Copy backends and checksums** on ``/dev/shm`` (no disk in the way, so the CPU work
   shows): ``torch`` vs ``numba`` copy, ``crc32c`` vs ``pcf64`` (fused into the numba copy
   or the mmap persist), plus verification cost on restore (``load_version``).

Configurations are run round-robin (rep 1 of every config, then rep 2, ...) so background load
on a shared machine hits all of them alike; medians are reported.

Run:  python experiments/engine/bench_persist_paths.py --mb 512 --reps 5 \\
          --out experiments/results/engine_paths_cpu.md
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pcframe import Checkpointer
from pcframe.restore.reader import load_version

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results


class Holder:
    """The state: ``count`` fp32 tensors of ``mb`` MiB in total."""

    def __init__(self, mb: int, count: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        numel = mb * (1 << 20) // 4 // count
        self.tensors = {f"t{i}": torch.randn(numel, generator=g) for i in range(count)}
        self.nbytes = sum(t.numel() * 4 for t in self.tensors.values())

    def state_dict(self) -> dict:
        return self.tensors

    def load_state_dict(self, state: dict) -> None:
        self.tensors = state


PERSIST = [
    ("disk", "pwrite (buffered)", {"persist": "write", "o_direct": "off"}),
    ("disk", "pwrite O_DIRECT", {"persist": "write", "o_direct": "on"}),
    ("disk", "mmap + msync", {"persist": "mmap"}),
    ("shm", "pwrite", {"persist": "write", "o_direct": "off"}),
    ("shm", "mmap + msync", {"persist": "mmap"}),
]
COPY = [
    ("torch copy, crc32c", {"copy_backend": "torch", "checksum": "crc32c"}),
    ("numba copy, crc32c", {"copy_backend": "numba", "checksum": "crc32c"}),
    ("torch copy, pcf64 (writer pass)", {"copy_backend": "torch", "checksum": "pcf64"}),
    ("numba copy, pcf64 fused in copy", {"copy_backend": "numba", "checksum": "pcf64"}),
    ("torch copy, mmap, crc32c", {"copy_backend": "torch", "checksum": "crc32c", "mmap": 1}),
    (
        "torch copy, mmap, pcf64 fused in persist",
        {"copy_backend": "torch", "checksum": "pcf64", "mmap": 1},
    ),
]


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads: copy, writers, commit, kernel)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(args: argparse.Namespace) -> str:
    holder = Holder(args.mb)
    roots = {
        "disk": Path(tempfile.mkdtemp(prefix="pcf-bench-", dir=args.disk_dir)),
        "shm": Path(tempfile.mkdtemp(prefix="pcf-bench-", dir="/dev/shm")),
    }
    cases = [(f"p{i}", fs, label, cfg) for i, (fs, label, cfg) in enumerate(PERSIST)]
    for i, (label, cfg) in enumerate(COPY):
        extra = {"persist": "mmap" if cfg.pop("mmap", 0) else "write", "o_direct": "off"}
        cases.append((f"c{i}", "shm", label, {**cfg, **extra}))
    engines, results = {}, {key: {"durable": [], "copy": [], "cpu": []} for key, *_ in cases}
    try:
        for key, fs, _, cfg in cases:
            engines[key] = Checkpointer(
                roots[fs] / key,
                stateful={"s": holder},
                keep_last=1,
                writer_threads=args.writers,
                **cfg,
            )
            engines[key].save(step=0).wait()  # warm-up: staging allocation, kernel compiles
        for rep in range(1, args.reps + 1):
            for key, *_ in cases:
                engine = engines[key]
                cpu = cpu_seconds()
                start = time.perf_counter()
                handle = engine.save(step=rep)
                handle.wait()
                results[key]["durable"].append(time.perf_counter() - start)
                results[key]["cpu"].append(cpu_seconds() - cpu)
                engine.wait()
                results[key]["copy"].append(engine.records[handle.version].copy)
            print(f"rep {rep}/{args.reps} done", file=sys.stderr)
        verify = {}
        for key, *_ in cases[len(PERSIST) :]:
            engine = engines[key]
            path = engine.directory / f"v{max(engine.committed_versions()):08d}"
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                load_version(path, threads=args.writers)
                times.append(time.perf_counter() - start)
            verify[key] = statistics.median(times)
    finally:
        for engine in engines.values():
            engine.close()
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    return report(args, holder.nbytes, cases, results, verify)


def report(args, nbytes, cases, results, verify) -> str:
    gb = nbytes / 1e9
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in results.items()}
    command = (
        f"python experiments/engine/bench_persist_paths.py --mb {args.mb} "
        f"--reps {args.reps} --writers {args.writers} --disk-dir {args.disk_dir} "
        f"--out {args.out}"
    )
    lines = [
        *header("Engine persist paths and copy backends (CPU)", command),
        f"State: {nbytes / (1 << 20):.0f} MiB of fp32 in 32 tensors; chunk 16 MiB; "
        f"{args.writers} writer threads; median of {args.reps} saves per configuration, "
        "configurations interleaved round-robin in one process. Machine: "
        f"{os.cpu_count()} CPU cores shared with other jobs (numbers are noisy; compare "
        "ratios within a table). Disk: the file system of `--disk-dir`; shm: `/dev/shm` "
        "(tmpfs).",
        "",
        "CPU = user + system CPU seconds the process spent from save() to committed (all "
        "threads, page faults and system calls included): less sensitive to other jobs than "
        "wall time.",
        "",
        "## Persist paths (time from save() to committed)",
        "",
    ]
    base = {
        fs: next(k for k, f, *_ in cases if f == fs and k.startswith("p")) for fs in ("disk", "shm")
    }
    rows = []
    for key, fs, label, _ in cases[: len(PERSIST)]:
        d, c = med[key]["durable"], med[key]["cpu"]
        ratio, cpu_ratio = d / med[base[fs]]["durable"], c / med[base[fs]]["cpu"]
        rows.append([fs, label, f"{d:.3f}", f"{gb / d:.2f}", f"{ratio:.2f}", f"{c:.3f}"])
        rows[-1].append(f"{cpu_ratio:.2f}")
    columns = ["file system", "path", "durable (s)", "GB/s", "÷ pwrite same fs", "CPU (s)", "÷"]
    lines += table_lines(columns, rows, align="llrrrrr")
    lines += [
        "",
        "## Copy backends and checksums on /dev/shm",
        "",
        "copy = seconds `save()` blocked (the copy stage; the optimizer step would wait this "
        "long); durable = save() to committed; verify = `load_version` (read + checksum "
        "every chunk, page cache warm). Ratios are to the first row (time ratios: < 1 is "
        "faster).",
        "",
    ]
    first = cases[len(PERSIST)][0]
    rows = []
    for key, _, label, _ in cases[len(PERSIST) :]:
        c, d, v, u = med[key]["copy"], med[key]["durable"], verify[key], med[key]["cpu"]
        rows.append(
            [
                label,
                f"{c:.3f}",
                f"{c / med[first]['copy']:.2f}",
                f"{d:.3f}",
                f"{d / med[first]['durable']:.2f}",
                f"{gb / d:.2f}",
                f"{u:.3f}",
                f"{u / med[first]['cpu']:.2f}",
                f"{v:.3f}",
                f"{v / verify[first]:.2f}",
            ]
        )
    columns = ["configuration", "copy (s)", "÷", "durable (s)", "÷", "GB/s", "CPU (s)", "÷"]
    columns += ["restore+verify (s)", "÷"]
    lines += table_lines(columns, rows, align="lrrrrrrrrr")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--disk-dir", default=tempfile.gettempdir())
    parser.add_argument("--out", default="experiments/results/engine_paths_cpu.md")
    args = parser.parse_args()
    text = run(args)
    write_results(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
