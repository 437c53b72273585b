"""Python's cyclic collector and the stall: saves of a 3200-tensor state with and without
the pause ``save()`` captures under (:mod:`pcframe.runtime.collector`).

The capture makes a few objects per tensor, which live until the version is written.
Without the pause, the collections they set off move them into older generations, and full
collections of the whole process (a model, its optimizer and torch: some 300,000 objects)
follow. This script checkpoints the state of ``stall_tensors.py`` (0.25 GiB as 400
``Linear`` layers with Adam) ``--checkpoints`` times in a loop (``optimizer.step()``, then
one checkpoint with nothing to overlap), in a fresh process per variant and repeat, the
variants alternating, and counts every collection (``gc.callbacks``) over the whole loop:
their number, the full ones, their time, and the stalls. ``unpaused`` replaces the pause
in ``Checkpointer.save`` by a no-op.

Run:  python experiments/engine/gc_saves.py --out experiments/results/gc_saves.md
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_engine import spread

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

VARIANTS = ("paused (default)", "unpaused")


def one_loop(args: argparse.Namespace) -> dict:
    """In this fresh process: the loop, with the collector's work counted."""
    import torch
    from methods import PCFrame, build_stack, stall_of_one

    import pcframe.save.flight

    if args.variant == "unpaused":
        pcframe.save.flight.collector_paused = contextlib.nullcontext
    torch.set_num_threads(2)
    model, optimizer = build_stack(0.25, args.layers)
    base = Path(tempfile.mkdtemp(prefix="pcframe-gc-", dir="/var/tmp"))
    try:
        impl = PCFrame(model, optimizer, base, max_in_flight=1)
        for _ in range(3):
            stall_of_one(impl)  # warm-up: allocations, threads
        gc.collect()  # none due from building the state: both variants start alike
        events: list[tuple[float, str, int]] = []
        gc.callbacks.append(
            lambda phase, info: events.append((time.perf_counter(), phase, info["generation"]))
        )
        stalls = []
        start = time.perf_counter()
        for _ in range(args.checkpoints):
            optimizer.step()
            stalls.append(stall_of_one(impl))
        wall = time.perf_counter() - start
        impl.ckpt.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    seconds, began = 0.0, None
    for at, phase, _ in events:
        if phase == "start":
            began = at
        elif began is not None:
            seconds, began = seconds + at - began, None
    starts = [generation for _, phase, generation in events if phase == "start"]
    return {
        "wall": wall,
        "collections": len(starts),
        "full": starts.count(2),
        "gc_seconds": seconds,
        "stalls": stalls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=400)
    parser.add_argument("--checkpoints", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="experiments/results/gc_saves.md")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one_loop(args)))
        return
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            cmd = [sys.executable, __file__, "--variant", variant, "--layers", str(args.layers)]
            cmd += ["--checkpoints", str(args.checkpoints)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
            last = runs[variant][-1]
            print(variant, {k: v for k, v in last.items() if k != "stalls"}, flush=True)

    command = (
        f"python experiments/engine/gc_saves.py --layers {args.layers} "
        f"--checkpoints {args.checkpoints} --repeats {args.repeats} --out {args.out}"
    )
    title = "The cyclic collector and the stall: saves with and without the capture's pause"
    lines = [
        *header(title, command),
        f"0.25 GiB as {args.layers} `Linear` layers with Adam ({args.layers * 8} tensors), "
        f"{args.checkpoints} checkpoints in a loop (`optimizer.step()`, then one checkpoint "
        "with nothing to overlap), a fresh process per variant and repeat, the variants "
        f"alternating; {args.repeats} repeats, median (min..max). Collections and their "
        "time are counted over the whole loop (saves, steps and the engine's threads), so "
        "work moved out of the stall into the step would still show.",
        "",
    ]
    rows = []
    for variant, results in runs.items():
        medians = [statistics.median(r["stalls"]) for r in results]
        maxima = [max(r["stalls"]) for r in results]
        rows.append(
            [
                variant,
                spread([r["collections"] for r in results], digits=0),
                spread([r["full"] for r in results], digits=0),
                spread([r["gc_seconds"] for r in results], digits=2),
                spread([r["wall"] for r in results], digits=2),
                spread(medians, 1000, 1),
                spread(maxima, 1000, 1),
            ]
        )
    columns = ["variant", "collections", "full collections", "collector time (s)", "loop (s)"]
    columns += ["stall median (ms)", "stall max (ms)"]
    lines += table_lines(columns, rows, align="lrrrrrr")
    text = "\n".join([*lines, ""])
    write_results(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
