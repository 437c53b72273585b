"""Time to durable on a page-cache file system: one data file against stripes, and the limits.

Buffered writes to one file take turns on its inode lock, so writer threads writing one
``data.bin`` into tmpfs go one at a time (the H200 run, experiments/results/gpu_h200.md,
was slower to durable on /dev/shm than DCP, which writes a file per thread). In each round
(a fresh random order, seeded) the same state is checkpointed by pcframe with
``stripes: 1`` and with ``stripes: 0`` (auto: one file per writer on tmpfs), and the page
cache's own limits are measured on the same directory: the state's bytes written by the
same number of threads into one file and into one file each (fallocated, ``pwrite`` of
16 MiB blocks, then ``fsync``). Ratios are paired within the round.

    python experiments/engine/bench_stripes.py --size-gb 0.47 --rounds 7 \\
        --out experiments/results/stripes_tmpfs.md
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_engine import spread
from methods import build_state

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

BLOCK = 16 << 20


def write_limit(directory: Path, nbytes: int, threads: int, files: int) -> float:
    """Seconds to write ``nbytes`` with ``threads`` threads into ``files`` files, synced."""
    block = os.urandom(BLOCK)
    blocks = -(-nbytes // BLOCK)
    paths = [directory / f"limit{i}.bin" for i in range(files)]
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in paths]
    try:
        for fd in fds:
            os.posix_fallocate(fd, 0, -(-blocks // files) * BLOCK)
        work = iter(range(blocks))
        lock = threading.Lock()

        def writer() -> None:
            while True:
                with lock:
                    k = next(work, None)
                if k is None:
                    return
                os.pwrite(fds[k % files], block, (k // files) * BLOCK)

        start = time.perf_counter()
        pool = [threading.Thread(target=writer) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        for fd in fds:
            os.fsync(fd)
        return time.perf_counter() - start
    finally:
        for fd in fds:
            os.close(fd)
        for p in paths:
            p.unlink()


def checkpoint(model, optimizer, directory: Path, stripes: int, writers: int, n: int):
    """``n`` checkpoints (after one warm-up); their (time to durable, copy) in seconds."""
    from pcframe import Checkpointer

    shutil.rmtree(directory, ignore_errors=True)
    config = {"stripes": stripes, "writer_threads": writers, "keep_last": 1}
    with Checkpointer(directory, model=model, optimizer=optimizer, **config) as ckpt:
        for step in range(n + 1):
            ckpt.save(step).wait()
        records = [ckpt.records[v] for v in sorted(ckpt.records)][1:]
    shutil.rmtree(directory, ignore_errors=True)
    return [(r.durable, r.copy) for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.47)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-case", type=int, default=3)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--dir", default="/dev/shm", help="a directory on tmpfs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from pcframe.store.mounts import file_system_type

    torch.set_num_threads(os.cpu_count() or 1)
    model, optimizer, nbytes = build_state(args.size_gb)
    root = Path(tempfile.mkdtemp(prefix="pcframe-stripes-", dir=args.dir))
    fs = file_system_type(root)
    cases = ["pcframe stripes: 1", "pcframe stripes: 0 (auto)", "limit: 1 file", "limit: files"]
    rng = random.Random(args.seed)
    rows: dict[str, list[float]] = {c: [] for c in cases}
    copies: dict[str, list[float]] = {c: [] for c in cases[:2]}
    ratios: dict[str, list[float]] = {"auto ÷ 1": [], "auto ÷ limit": [], "1 ÷ limit": []}
    try:
        for r in range(args.rounds):
            order = cases[:]
            rng.shuffle(order)
            got: dict[str, float] = {}
            for case in order:
                if case.startswith("limit"):
                    files = 1 if case == "limit: 1 file" else args.writers
                    got[case] = min(
                        write_limit(root, nbytes, args.writers, files) for _ in range(2)
                    )
                else:
                    stripes = 1 if case == "pcframe stripes: 1" else 0
                    saves = checkpoint(
                        model, optimizer, root / "ckpt", stripes, args.writers, args.per_case
                    )
                    got[case] = statistics.median(d for d, _ in saves)
                    copies[case].append(statistics.median(c for _, c in saves))
                rows[case].append(got[case])
            auto, one = got["pcframe stripes: 0 (auto)"], got["pcframe stripes: 1"]
            ratios["auto ÷ 1"].append(auto / one)
            ratios["auto ÷ limit"].append(got["limit: files"] / auto)
            ratios["1 ÷ limit"].append(got["limit: files"] / one)
            print(f"round {r}: " + ", ".join(f"{c} {got[c]:.3f}s" for c in cases), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb = nbytes / 1e9
    command = (
        f"python experiments/engine/bench_stripes.py --size-gb {args.size_gb} "
        f"--rounds {args.rounds} --per-case {args.per_case} --writers {args.writers} "
        f"--dir {args.dir}"
    )
    note = f"{os.cpu_count()} CPUs; directory on {fs or 'unknown'}"
    lines = [
        *header("Time to durable on tmpfs: one data file against stripes", command, note),
        f"State: {nbytes / 2**30:.2f} GiB (model + Adam moments, fp32, CPU), "
        f"{args.writers} writer threads, crc32c per chunk. {args.rounds} rounds in a random "
        f"order; pcframe's figure per round is the median of {args.per_case} checkpoints "
        "after a warm-up one (time from `save()` to durable, the snapshot copy included); a "
        "limit is the best of 2 runs of the same bytes written by the same number of threads "
        "(`pwrite` of 16 MiB blocks into fallocated files, then `fsync`). Median (min..max) "
        "over rounds.",
        "",
        *table_lines(
            ["case", "seconds", "GB/s"],
            [[c, spread(rows[c]), spread([gb / v for v in rows[c]], digits=2)] for c in cases],
            align="lrr",
        ),
        "",
        "Paired within a round (median (min..max)):",
        "",
        f"- time to durable, auto stripes ÷ one file: {spread(ratios['auto ÷ 1'], digits=2)}",
        "- durable rate ÷ the files limit: auto "
        f"{spread(ratios['auto ÷ limit'], digits=2)}, one file "
        f"{spread(ratios['1 ÷ limit'], digits=2)}",
        "- snapshot copy inside those times: one file "
        f"{spread(copies['pcframe stripes: 1'])} s, auto "
        f"{spread(copies['pcframe stripes: 0 (auto)'])} s",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_results(args.out, text)


if __name__ == "__main__":
    main()
