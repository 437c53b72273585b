"""Engine benchmark: pcframe against the 2026 anchors, and against the machine's limits.

The same state (a model + Adam moments, about ``--size-gb`` GiB on CPU) is checkpointed by
each method in a process of its own (so peak memory is per method; :mod:`methods`):

* ``torch.save`` (+ fsync), restored by ``torch.load(weights_only=True)`` + ``load_state_dict``
  (the restore anchor);
* ``dcp.save``; ``dcp.async_save`` as it was in 2024 (a staging copy inside the call);
* ``dcp.async_save`` with ``DefaultStager`` (torch >= 2.9: background staging into buffers it
  reuses; the training loop waits for ``staging_completion`` before ``optimizer.step()``, as
  its tutorial says; pinned memory on CUDA): the stall anchor;
* pcframe with one and two versions in flight (the defaults otherwise).

**Stall with nothing to overlap**, in rounds: every method's process is started once and
kept; each round gives every method a turn, in a fresh random order (seeded), of
``--checkpoints`` checkpoints with no compute between ``save()`` and the next
``optimizer.step()`` (the worst case: nothing to overlap the copy with). Each checkpoint
starts once the previous one is durable, so its stall is the snapshot alone (for
DefaultStager: ``async_save`` until ``staging_completion``). Just before each turn the
parent times one memcpy of the state's bytes (the memory's limit in that minute); after
each round it measures the disk's synced O_DIRECT write rate with 1 and 4 writers
(:mod:`pcframe.apps.limits`). A shared machine drifts by tens of percent within a minute,
so every ratio is taken inside a round (method ÷ DefaultStager of the same round, ÷ the
memcpy just before its turn, ÷ the round's disk write rate) and the table gives their median
and min..max over rounds.

Then, one method at a time, a loop with an idle iteration of ``--iteration-ms`` per step
(accelerator compute leaves the CPU free) and a checkpoint every ``--every`` steps; peak
extra host memory (RSS high-water mark over the resident state). Then ``--restores`` rounds
of cold restores of every method's newest checkpoint, each in a fresh process, paired
within each round (``restore_rounds.py``).

Run:  python experiments/engine/bench_engine.py --size-gb 0.47 \
          --out experiments/results/engine_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from methods import (
    METHODS,
    PCFrame,
    build_state,
    build_state_bytes,
    loop,
    make_method,
    reset_peak,
    rss_bytes,
)

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

# --- inside each method's process: commands in on stdin, replies out as JSON lines ---------


def serve_method(args: argparse.Namespace) -> None:
    """Build the state and the method, warm up once, then answer the parent's commands."""
    import torch

    channel = os.fdopen(os.dup(1), "w")  # replies only: anything a library prints goes to
    os.dup2(2, 1)  # stderr, not into the parent's JSON

    def reply(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    torch.set_num_threads(2)
    model, optimizer, _ = build_state(args.size_gb)
    # Imports and construction before the baseline: peak extra memory is what checkpointing
    # holds (staging, cached copies, buffers), not the size of a library's code.
    impl = make_method(args.method, json.loads(args.options), model, optimizer, Path(args.dir))
    # The snapshot's own floor, here: the state's tensors copied into one buffer already
    # faulted in (before the baseline: the buffer is the benchmark's, not the method's).
    sources = state_tensors(model, optimizer)
    gather_into = torch.zeros(sum(t.numel() * t.element_size() for t in sources), dtype=torch.uint8)
    baseline = rss_bytes()
    reset_peak()
    loop(impl, 1, 1, 0.0)  # warm-up: first-time allocations, imports, thread starts
    reply({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "idle":

            def floor() -> float:
                return statistics.median(gather_seconds(sources, gather_into))

            result = loop(impl, command["checkpoints"], 1, 0.0, reference=floor)
            impl.prune()  # every turn writes to the same free space and page cache
            reply(result)
            continue
        overlap = loop(impl, command["checkpoints"], command["every"], command["iteration"])
        overlap["peak_extra_bytes"] = rss_bytes("VmHWM") - baseline
        if isinstance(impl, PCFrame):  # what its staging pool may hold, by its config
            overlap["staging_bytes"] = impl.ckpt.staging_bytes
        impl.finish()
        impl.prune()  # the restore rounds read only the newest checkpoint: free the disk
        reply(overlap)
        return


def state_tensors(model, optimizer) -> list:
    """Every tensor of the state: the weights, then the optimizer's."""
    import torch

    sources = [p.detach() for p in model.parameters()]
    return sources + [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def gather_seconds(sources: list, into, repeats: int = 3) -> list[float]:
    """Seconds per copy of every tensor in ``sources`` into ``into``, back to back: a memcpy
    of the snapshot's bytes from where they live, in the process that snapshots them (the
    parent's memcpy is of two fresh contiguous buffers)."""
    import torch

    spans, offset = [], 0
    for t in sources:
        n = t.numel() * t.element_size()
        spans.append((t.reshape(-1).view(torch.uint8), into[offset : offset + n]))
        offset += n
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for src, dst in spans:
            dst.copy_(src)
        times.append(time.perf_counter() - start)
    return times


class MethodProcess:
    """One method's process, kept for the whole run."""

    def __init__(self, args: argparse.Namespace, method: str, options: str, directory: Path):
        cmd = [sys.executable, __file__, "--method", method, "--options", options]
        cmd += ["--dir", str(directory), "--size-gb", str(args.size_gb)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.read()  # built and warmed up

    def ask(self, **command) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a method's process died (exit {self.proc.wait()}); see stderr")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


# --- the parent: processes, rounds, the table ------------------------------------------------


def spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    if not values:
        return "—"
    med = statistics.median(values) * scale
    return f"{med:.{digits}f} ({min(values) * scale:.{digits}f}..{max(values) * scale:.{digits}f})"


def label_of(method: str, options: str) -> str:
    return method if method != "pcframe" else f"pcframe {options}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.47)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of stall turns")
    parser.add_argument("--checkpoints", type=int, default=3, help="per method per round")
    parser.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=0, help="of the turns' random order")
    parser.add_argument("--iteration-ms", type=float, default=300.0)
    parser.add_argument("--restores", type=int, default=5, help="rounds of cold restores")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument("--out", default="experiments/results/engine_cpu.md")
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.method:
        serve_method(args)
        return

    import torch

    from pcframe.apps.limits import copy_seconds, measure_limits

    torch.set_num_threads(2)
    base = Path(args.dir or tempfile.mkdtemp(prefix="pcframe-bench-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    nbytes = build_state_bytes(args.size_gb)
    limits = [measure_limits(base, nbytes, repeats=3)]
    processes: dict[str, MethodProcess] = {}
    directories: dict[str, Path] = {}
    for i, (method, options) in enumerate(METHODS):
        directory = directories[label_of(method, options)] = base / f"run{i}"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        processes[label_of(method, options)] = MethodProcess(args, method, options, directory)
        print("started", label_of(method, options), flush=True)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    saving = [label for label in processes if label != "no checkpoint"]
    # A fresh random order each round (seeded): a rotation would keep every method right
    # behind the same one, and whatever a turn leaves behind would bias its successor.
    order = random.Random(args.seed)
    rounds = []
    for r in range(args.rounds):
        row: dict = {"memcpy": {}, "idle": {}}
        for label in order.sample(saving, len(saving)):
            row["memcpy"][label] = statistics.median(copy_seconds(dst, src, 3))
            row["idle"][label] = processes[label].ask(do="idle", checkpoints=args.checkpoints)
        row["limits"] = measure_limits(base, nbytes, repeats=1)
        limits.append(row["limits"])
        rounds.append(row)
        stalls = {k: round(statistics.median(v["stalls"]), 4) for k, v in row["idle"].items()}
        print(f"stall round {r + 1}:", json.dumps(stalls), flush=True)
    del src, dst
    results = []
    for label, process in processes.items():
        overlap = process.ask(
            do="overlap",
            checkpoints=args.checkpoints * 2,
            every=args.every,
            iteration=args.iteration_ms / 1000,
        )
        process.close()
        results.append({"method": label, "overlap": overlap})
        print(label, "overlap", json.dumps(overlap["stalls"]), flush=True)
    # Restores in rounds over every method's newest checkpoint, a process each (paired).
    restorable = [
        [label_of(m, o), m, o, str(directories[label_of(m, o)])]
        for m, o in METHODS
        if m != "no checkpoint"
    ]
    rounds_json = base / "rounds.json"
    cmd = [sys.executable, str(Path(__file__).with_name("restore_rounds.py"))]
    cmd += ["--size-gb", str(args.size_gb), "--rounds", str(args.restores)]
    cmd += ["--methods", json.dumps(restorable), "--json", str(rounds_json)]
    subprocess.run(cmd, check=True)
    restores = json.loads(rounds_json.read_text())
    shutil.rmtree(base, ignore_errors=True)
    write_table(args, nbytes, rounds, results, limits, restores)


def write_table(
    args, nbytes: int, rounds: list[dict], results: list[dict], limits: list, restores: list
) -> None:
    from pcframe.apps.limits import MachineLimits, Throughput

    def pooled(attr: str) -> Throughput:
        rates = [getattr(lim, attr) for lim in limits]
        return Throughput(
            statistics.median(r.median for r in rates),
            min(r.low for r in rates),
            max(r.high for r in rates),
        )

    lim = MachineLimits(
        nbytes,
        pooled("memcpy"),
        pooled("memcpy_one_thread"),
        pooled("disk_write_1"),
        pooled("disk_write_4"),
        pooled("disk_read"),
        limits[0].direct,
    )
    memcpy_s, disk_s = lim.memcpy_seconds(nbytes), lim.disk_seconds(nbytes)
    med = statistics.median
    anchor = "dcp.async_save + DefaultStager"

    def per_round(label: str, kind: str) -> list[float]:
        return [med(r["idle"][label][kind]) for r in rounds]

    gib = 1 << 30
    command = (
        "python experiments/engine/bench_engine.py "
        f"--size-gb {args.size_gb} --rounds {args.rounds} --checkpoints {args.checkpoints} "
        f"--seed {args.seed} "
        f"--every {args.every} --iteration-ms {args.iteration_ms:g} "
        f"--restores {args.restores} --out {args.out}"
    )
    title = "Engine benchmark (CPU): pcframe vs the 2026 anchors and the machine's limits"
    lines = [
        *header(title, command),
        f"State: {nbytes / gib:.2f} GiB (model + Adam moments, fp32, CPU), one process per "
        "method, kept for the whole run, one warm-up checkpoint each. Numbers are medians "
        "(min..max).",
        "",
        "Limits, same run (median over the run, min..max):",
        *[f"- {line}" for line in lim.lines()],
        f"- so one memcpy of the state takes {memcpy_s:.3f} s and the disk needs "
        f"{disk_s:.3f} s to make it durable; reading it back cold takes at least "
        f"{lim.read_seconds(nbytes):.3f} s",
        "",
        "## Stall with nothing to overlap (save(), then optimizer.step() at once)",
        "",
        f"{args.rounds} rounds; in each, every method's process takes a turn of "
        f"{args.checkpoints} checkpoints (a fresh random order each round), each started once "
        "the previous one is durable. The parent times one memcpy of the state's bytes (2 "
        "threads, median of 3) just before each turn, and the disk's synced O_DIRECT write rate "
        "(best of 1 and 4 writers, one measurement) after each round: a reference, not a "
        "bound, since one measurement of this virtual disk moves by ±30 %. "
        "Ratios are paired: the turn's median ÷ DefaultStager's in the same round, ÷ the "
        "parent's memcpy just before the turn, the turn's durable rate ÷ the round's disk "
        "rate (median (min..max) over rounds); and each checkpoint's stall ÷ the method's "
        "own process copying the state's tensors into one buffer (2 threads, median of 3) "
        "just before that checkpoint, once the previous one is durable (median (min..max) "
        "over every checkpoint): the same bytes from where they live, in the same second. "
        "This is the snapshot's floor; the parent's two fresh contiguous buffers, a minute "
        "apart and in another process, can copy faster or slower.",
        "",
    ]
    rows = []
    for label in [r["method"] for r in results if r["method"] in rounds[0]["idle"]]:
        stalls = [s for r in rounds for s in r["idle"][label]["stalls"]]
        durables = [d for r in rounds for d in r["idle"][label]["durables"]]
        pairs = zip(per_round(label, "stalls"), per_round(anchor, "stalls"), strict=True)
        to_anchor = [a / b for a, b in pairs]
        to_memcpy = [med(r["idle"][label]["stalls"]) / r["memcpy"][label] for r in rounds]
        here = [
            stall / floor
            for r in rounds
            for stall, floor in zip(
                r["idle"][label]["stalls"], r["idle"][label]["references"], strict=True
            )
        ]
        to_disk = [
            r["limits"].disk_seconds(nbytes) / med(r["idle"][label]["durables"]) for r in rounds
        ]
        rows.append(
            [
                label,
                spread(stalls),
                spread(to_anchor, digits=2),
                spread(to_memcpy, digits=2),
                spread(here, digits=2),
                spread(durables, digits=2),
                spread(to_disk, digits=2),
            ]
        )
    columns = ["method", "stall (s)", "÷ DefaultStager", "÷ parent's memcpy"]
    columns += ["÷ memcpy in its process, per checkpoint", "time to durable (s)"]
    columns += ["durable rate ÷ the round's disk rate"]
    lines += table_lines(columns, rows, align="lrrrrrr")
    by = {r["method"]: r for r in results}
    baseline_peak = by["no checkpoint"]["overlap"]["peak_extra_bytes"]
    lines += [
        "",
        f"## With {args.iteration_ms:g} ms of idle CPU per step (accelerator compute), a "
        f"checkpoint every {args.every} steps; host memory",
        "",
        "Here nothing waits for the copy, so the writers start at once; the durable rate is "
        "divided by the run's median disk rate (this phase is not paired).",
        "",
    ]
    rows = []
    for r in results:
        if r["method"] == "no checkpoint":
            alone = f"{baseline_peak / gib:.2f}"
            rows.append(["no checkpoint (the loop alone)", "—", "—", "—", alone, "—", "—", "—"])
            continue
        stalls, durables = r["overlap"]["stalls"], r["overlap"]["durables"]
        peak = r["overlap"]["peak_extra_bytes"]
        above = peak - baseline_peak
        budget = r["overlap"].get("staging_bytes")
        rows.append(
            [
                r["method"],
                spread(stalls, 1000, 1),
                spread(durables, digits=2),
                f"{disk_s / med(durables):.2f}",
                f"{peak / gib:.2f}",
                f"{above / gib:.2f}",
                f"{above / nbytes:.2f}",
                f"{above / budget:.2f}" if budget else "—",
            ]
        )
    columns = ["method", "stall (ms)", "time to durable (s)", "durable rate ÷ the run's disk rate"]
    columns += ["peak extra host mem (GiB)", "above the loop alone (GiB)", "÷ state size"]
    columns += ["÷ its staging budget"]
    lines += table_lines(columns, rows, align="lrrrrrrr")
    labels = list(restores[0]["live"])

    def times(kind: str, label: str) -> list[float]:
        return [r[kind][label] for r in restores]

    def paired(kind: str, label: str, anchor: str) -> str:
        """Median (min..max) over rounds of label ÷ anchor, both timed in the same round."""
        ratios = [r[kind][label] / r[kind][anchor] for r in restores]
        return spread(ratios, digits=2)

    read_limits = [r["read_limit"] for r in restores if r["read_limit"]]
    lines += [
        "",
        "## Cold restore (page cache "
        + ("dropped" if all(r["cold_cache"] for r in restores) else "warm: could not drop it")
        + " before each)",
        "",
        f"{len(restores)} rounds (`restore_rounds.py`): each round restores every "
        "method's newest checkpoint three ways, each restore in a fresh process of its own, "
        "in an order rotated per round: **rollback**, the process saves one checkpoint with "
        "its method (as a training job has) and loads the newest back into its own objects "
        "(pcframe's checkpointer copies it from its staging buffers, which still hold it, "
        "each chunk checked against its checksum: no file is read; the **live** rows are its "
        "restore from disk); **live**, into live objects (the optimizer has its state) of a "
        "process that never saved (pcframe verifies first, then reads the verified bytes "
        "again from the page cache); **resume**, into a model built afresh and an optimizer "
        "without state, as a restarted job does. Then it reads pcframe's data "
        "file cold with plain threads (the disk's read limit, best of 1/2/4 readers × 16 MiB, "
        f"this run: {spread(read_limits, digits=3)} s). Ratios are paired: each round's time "
        "÷ the anchor's of the same kind in the same round, median (min..max) over rounds.",
        "",
    ]

    def to_limit(kind: str, label: str) -> str:
        """Median (min..max) of the restore ÷ the disk's cold-read time in the same round."""
        return spread(
            [r[kind][label] / r["read_limit"] for r in restores if r["read_limit"]], digits=2
        )

    kinds = [k for k in ("rollback", "live", "resume") if k in restores[0]]
    rows = [
        [
            kind,
            label,
            spread(times(kind, label), digits=2),
            paired(kind, label, "torch.save"),
            paired(kind, label, "dcp.save"),
            to_limit(kind, label),
        ]
        for kind in kinds
        for label in labels
    ]
    columns = ["restore", "method", "time (s)", "÷ torch.load", "÷ dcp.load", "÷ read limit"]
    lines += table_lines(columns, rows, align="llrrrr")
    lines += [
        "",
        "torch.load's rows are `torch.load(weights_only=True)` + `load_state_dict` of both; "
        "dcp.load's are `get_state_dict` + `dcp.load` + `set_state_dict`; pcframe verifies "
        "every chunk's checksum and reads into the live tensors where they exist. "
        "Peak extra memory is the RSS high-water mark above the resident state after the "
        "method's imports and set-up; the loop alone (Adam's temporaries) is the first row, "
        "and the column after it is what checkpointing holds on top (DefaultStager caches a "
        "full staged copy; pcframe's staging pool is one version, `staging_ratio: 1.0`).",
    ]
    write_results(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
