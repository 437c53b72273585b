"""A/B in one process: a rollback restore with the idle staging pool lent (read once,
straight into the live tensors, their old bytes kept in the pool) against the same restore
reading twice (verify, then read the verified bytes again from the page cache).

One checkpointer saves the state once (its pool is then resident and idle, as in a training
job), then restores the newest version ``--repeats`` times each way, alternating which goes
first, the page cache dropped before each (needs root). Reported: each way's median
(min..max) and the median of the paired ratios (with pool ÷ without, same pair).

    python experiments/engine/rollback_backup.py --size-gb 0.47 --repeats 12 \
        --out experiments/results/rollback_backup.md
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from methods import build_state, drop_caches

from pcframe import Checkpointer

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results


def spread(values: list[float], digits: int = 3) -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}..{high:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.47)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, optimizer, _ = build_state(args.size_gb)
    times: dict[str, list[float]] = {"pool lent": [], "read twice": []}
    with contextlib.ExitStack() as stack:
        directory = args.dir or stack.enter_context(tempfile.TemporaryDirectory(dir="."))
        # take_over: a --dir given again holds an earlier run's versions, scratch to replace
        # (the rollbacks timed here go back to the version this run saves first).
        ckpt = stack.enter_context(
            Checkpointer(directory, model=model, optimizer=optimizer, take_over=True)
        )
        ckpt.save(1).wait()
        pool = ckpt._pipeline.pool
        lend = pool.lend
        # Both ways read the disk: a rollback of the version just saved would otherwise be
        # copied from the staging buffers that still hold it (restore/staged.py).
        pool.holding = lambda lent: {}
        for i in range(args.repeats):
            order = list(times) if i % 2 == 0 else list(reversed(times))
            for way in order:
                pool.lend = lend if way == "pool lent" else lambda: contextlib.nullcontext([])
                if not drop_caches():
                    raise SystemExit("cannot drop the page cache (needs root)")
                start = time.perf_counter()
                ckpt.restore()
                times[way].append(time.perf_counter() - start)
                direct = ckpt.last_restore.direct_bytes
                assert (direct > 0) == (way == "pool lent"), (way, direct)
        pool.lend = lend
        nbytes = ckpt.last_restore.in_place_bytes
    ratios = [a / b for a, b in zip(times["pool lent"], times["read twice"], strict=True)]
    command = (
        f"python experiments/engine/rollback_backup.py --size-gb {args.size_gb} "
        f"--repeats {args.repeats}" + (f" --out {args.out}" if args.out else "")
    )
    lines = [
        *header("Rollback restore: the idle staging pool lent vs reading twice", command),
        f"One process, one checkpointer that saved once ({nbytes / 2**30:.2f} GiB read into "
        "the live model and Adam moments), then restores of that version alternating the two "
        "ways, the page cache dropped before each. Seconds, median (min..max) over "
        f"{args.repeats} restores each; the ratio is paired (same pair, with pool ÷ without).",
        "",
        *table_lines(["way", "restore (s)"], [[w, spread(v)] for w, v in times.items()], "lr"),
        "",
        f"Paired ratio (pool lent ÷ read twice): {spread(ratios, 2)}",
    ]
    print("\n".join(lines))
    if args.out:
        write_results(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
