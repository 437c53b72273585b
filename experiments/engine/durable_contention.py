"""Time to durable while the training step takes the CPU, against the disk's limit.

``bench_engine.py``'s stall phase runs ``optimizer.step()`` at once after ``save()``. On a
CPU-only host that step is Adam over the whole model, on every core, for about as long as
the disk needs to make the checkpoint durable: the writers' checksums and system calls
share the cores with it. This script separates the two. In each round (a fresh random
order of the cases, seeded) pcframe saves the same state:

* ``step at once``: ``save()``, then ``optimizer.step()`` at once;
* ``steps until durable``: ``save()``, then ``optimizer.step()`` again and again until the
  version is durable (the stall phase's loop keeps stepping: the CPU is never idle);
* ``nothing after``: ``save()``, then only the wait (the CPU is the writers' alone, as when
  the step runs on an accelerator);

and it times the step alone and measures the disk's synced O_DIRECT write limit (best of 1
and 4 writers) right after the round. A plain writer (the limits module's: four threads
writing the state's bytes with O_DIRECT in 16 MiB requests, no checksum, then ``fsync``) is
timed alone and with the same step running beside it: how much of the slowdown is the
machine's own (the disk's completions and the memory bus shared with Adam) rather than
pcframe's. Ratios are paired within the round.

    python experiments/engine/durable_contention.py --size-gb 0.47 --rounds 9 \\
        --out experiments/results/durable_contention.md
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench_engine import spread
from methods import build_state

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

CASES = ("step at once", "steps until durable", "nothing after")
BLOCK = 16 << 20


def plain_write_seconds(path: Path, nbytes: int, beside: Callable[[], object] | None) -> float:
    """The limits module's writer (4 threads, O_DIRECT, 16 MiB requests, then fsync), with
    ``beside()`` running on another thread meanwhile."""
    from pcframe.apps.limits import write_seconds

    side = threading.Thread(target=beside) if beside is not None else None
    if side:
        side.start()
    try:
        return write_seconds(path, nbytes, 4, BLOCK, direct=True)
    finally:
        if side:
            side.join()
        path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.47)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--per-case", type=int, default=3, help="checkpoints per case per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-in-flight", type=int, default=2)
    parser.add_argument("--out", default="experiments/results/durable_contention.md")
    args = parser.parse_args()

    import torch

    from pcframe import Checkpointer
    from pcframe.apps.limits import measure_limits

    torch.set_num_threads(2)
    base = Path(tempfile.mkdtemp(prefix="pcframe-bench-contention-", dir="/var/tmp"))
    model, optimizer, nbytes = build_state(args.size_gb)
    order = random.Random(args.seed)
    rows: list[dict] = []
    try:
        with Checkpointer(
            base / "ckpt", model=model, optimizer=optimizer, max_in_flight=args.max_in_flight
        ) as ckpt:
            step = 0
            for _ in range(2):  # warm-up: the staging pool and the files' first use
                step += 1
                ckpt.save(step)
                ckpt.wait()
            for r in range(args.rounds):
                durable: dict[str, list[float]] = {case: [] for case in CASES}
                steps = []
                for case in order.sample(CASES * args.per_case, len(CASES) * args.per_case):
                    step += 1
                    handle = ckpt.save(step)
                    if case == "step at once":
                        optimizer.step()
                    elif case == "steps until durable":  # training never lets the CPU go
                        while not handle.done():
                            optimizer.step()
                    ckpt.wait()
                    durable[case].append(ckpt.records[max(ckpt.records)].durable)
                    start = time.perf_counter()
                    optimizer.step()  # the step alone: nothing in flight now
                    steps.append(time.perf_counter() - start)
                plain = base / "plain.bin"
                alone = [plain_write_seconds(plain, nbytes, None) for _ in range(2)]
                stepping = [plain_write_seconds(plain, nbytes, optimizer.step) for _ in range(2)]
                limits = measure_limits(base, nbytes, repeats=1)
                row = {case: statistics.median(v) for case, v in durable.items()}
                row["plain alone"] = statistics.median(alone)
                row["plain beside the step"] = statistics.median(stepping)
                row["step"] = statistics.median(steps)
                row["disk"] = limits.disk_seconds(nbytes)
                rows.append(row)
                print(f"round {r + 1}:", {k: round(v, 3) for k, v in row.items()}, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    write_table(args, nbytes, rows)


def write_table(args: argparse.Namespace, nbytes: int, rows: list[dict]) -> None:
    import platform

    import torch

    command = (
        "python experiments/engine/durable_contention.py "
        f"--size-gb {args.size_gb} --rounds {args.rounds} --per-case {args.per_case} "
        f"--seed {args.seed} --max-in-flight {args.max_in_flight} --out {args.out}"
    )
    lines = [
        *header("Time to durable while the training step takes the CPU", command),
        f"State: {nbytes / (1 << 30):.2f} GiB (model + Adam moments, fp32, CPU), pcframe "
        f"defaults with `max_in_flight: {args.max_in_flight}`, torch {torch.__version__} on "
        f"{torch.get_num_threads()} threads, {platform.machine()}. {args.rounds} rounds of "
        f"{args.per_case} checkpoints per case in a random order; the disk's limit (best of "
        "1 and 4 synced O_DIRECT writers) measured after each round. Median (min..max) over "
        "rounds of each round's median.",
        "",
    ]
    cases = [(f"pcframe, {case}", case) for case in CASES] + [
        ("plain O_DIRECT writer, alone", "plain alone"),
        ("plain O_DIRECT writer, the step beside it", "plain beside the step"),
    ]
    table = []
    for label, key in cases:
        seconds = [row[key] for row in rows]
        ratios = [row["disk"] / row[key] for row in rows]
        table.append([label, spread(seconds, digits=3), spread(ratios, digits=2)])
    columns = ["case", "time to durable (s)", "durable rate ÷ the round's disk rate"]
    lines += table_lines(columns, table, align="lrr")
    steps = [row["step"] for row in rows]
    disk = [row["disk"] for row in rows]
    cost = [row["step at once"] / row["nothing after"] for row in rows]
    busy = [row["steps until durable"] / row["nothing after"] for row in rows]
    plain_cost = [row["plain beside the step"] / row["plain alone"] for row in rows]
    lines += [
        "",
        f"- The Adam step alone: {spread(steps, digits=3)} s; the disk's limit for the state: "
        f"{spread(disk, digits=3)} s, so the step takes "
        f"{statistics.median(s / d for s, d in zip(steps, disk, strict=True)):.2f}x the "
        "disk's time, on every core.",
        f"- Time to durable with the step ÷ without it, paired: pcframe {spread(cost, digits=2)}; "
        f"the plain writer {spread(plain_cost, digits=2)}. With steps until durable (the "
        f"CPU never idle while the version is written) ÷ without: {spread(busy, digits=2)}.",
        "",
    ]
    write_results(args.out, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
