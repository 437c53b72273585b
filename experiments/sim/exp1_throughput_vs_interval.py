"""Experiment 1 (PCcheck-style): training throughput vs checkpoint interval, real engine.

A real CPU training workload (the GPT-style model of ``pcframe.apps.workloads``) checkpointed
every k = 1, 5, 10, 25, 50, 100 iterations by

* ``torch.save``: blocking ``torch.save`` of model + optimizer, fsync, atomic rename;
* ``DCP async``: ``torch.distributed.checkpoint.async_save``, one save in flight (the next
  one waits for the previous future, as the DCP docs advise);
* ``CheckFreq-like``: CheckFreq's two phases re-implemented: a snapshot into preallocated
  host buffers (synchronous here: on CPU there is no device copy to overlap), then a
  background persist (torch.save + fsync + rename); one checkpoint in flight (a new
  snapshot waits until the previous persist is durable);
* ``pcframe N=1..4``: the engine with ``max_in_flight=N`` (snapshot gated before the
  optimizer step, chunked parallel persist, crash-safe commit, checksums).

Throughput = steps / wall seconds of the training loop (stalls included, the final drain
of in-flight saves excluded; the loop runs 10 steps past the last multiple of 100 so the
last save can overlap). The machine is shared with other jobs, which add only delay, so
each point is the fastest of ``--repeats`` runs (the least disturbed one, as ``timeit``
does), the methods are interleaved with no-checkpoint runs, the slowdown is relative to the
fastest no-checkpoint run, and the process asks for a higher CPU priority (``--nice``).

    python experiments/sim/exp1_throughput_vs_interval.py [--steps 110] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, csv_header, header, write_results

from pcframe import Checkpointer, EngineConfig
from pcframe.apps.training import batches
from pcframe.apps.workloads import Workload, build
from pcframe.policies import FixedSteps
from pcframe.sim.report import markdown_table, plot_lines, read_csv, write_csv

INTERVALS = (1, 5, 10, 25, 50, 100)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class Method:
    """A checkpointing method: ``after_step(step)`` in the loop, ``drain()`` at the end."""

    name = ""

    def __init__(self, workload: Workload, directory: Path, every: int) -> None:
        self.w, self.dir, self.every = workload, directory, every
        self.saves = 0

    def after_step(self, step: int) -> None:
        if step % self.every == 0:
            self.saves += 1
            self.save(step)

    def save(self, step: int) -> None:
        del step

    def drain(self) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {"model": self.w.model.state_dict(), "optimizer": self.w.optimizer.state_dict()}


class NoCheckpoint(Method):
    name = "no checkpoint"


class TorchSave(Method):
    name = "torch.save"

    def save(self, step: int) -> None:
        _durable_torch_save(self.state(), self.dir / "ckpt.pt")


class DcpAsync(Method):
    name = "DCP async"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.future: Any = None

    def save(self, step: int) -> None:
        if self.future is not None:
            self.future.result()  # one in flight
        self.future = self.dcp.async_save(self.state(), checkpoint_id=str(self.dir / f"s{step}"))

    def drain(self) -> None:
        if self.future is not None:
            self.future.result()


class CheckFreqLike(Method):
    name = "CheckFreq-like"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.buffers: dict[str, torch.Tensor] | None = None
        self.thread: threading.Thread | None = None

    def _flat(self) -> dict[str, torch.Tensor]:
        out = {f"model/{k}": v for k, v in self.w.model.state_dict().items()}
        for i, st in self.w.optimizer.state_dict()["state"].items():
            out.update({f"opt/{i}/{k}": v for k, v in st.items() if torch.is_tensor(v)})
        return out

    def save(self, step: int) -> None:
        if self.thread is not None:
            self.thread.join()  # one in flight: the previous persist must be durable
        live = self._flat()
        if self.buffers is None:  # preallocated host buffers, reused (CheckFreq's snapshot)
            self.buffers = {k: torch.empty_like(v) for k, v in live.items()}
        for k, v in live.items():
            self.buffers[k].copy_(v)
        snap = dict(self.buffers)
        self.thread = threading.Thread(
            target=_durable_torch_save, args=(snap, self.dir / "ckpt.pt"), daemon=True
        )
        self.thread.start()

    def drain(self) -> None:
        if self.thread is not None:
            self.thread.join()


def pcframe_method(n: int) -> type[Method]:
    class Pcframe(Method):
        name = f"pcframe N={n}"

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.ckpt = Checkpointer(
                self.dir,
                model=self.w.model,
                optimizer=self.w.optimizer,
                scheduler=self.w.scheduler,
                data=self.w.loader,
                policy=FixedSteps(self.every),
                config=EngineConfig(max_in_flight=n, staging_ratio=2.0),
            )

        def after_step(self, step: int) -> None:
            if self.ckpt.maybe_save(step) is not None:
                self.saves += 1

        def drain(self) -> None:
            self.ckpt.close()

    return Pcframe


METHODS: list[Callable[..., Method]] = [
    TorchSave,
    DcpAsync,
    CheckFreqLike,
    *(pcframe_method(n) for n in (1, 2, 3, 4)),
]


def run_once(
    method: type[Method], every: int, steps: int, width: int, root: Path
) -> dict[str, Any]:
    workload = build("gpt", width=width, layers=4)
    directory = Path(tempfile.mkdtemp(dir=root))
    stream = batches(workload)
    for _ in range(3):  # warm up kernels and the allocator outside the timed loop
        workload.train_step(next(stream))
    m = method(workload, directory, every)
    begin = time.perf_counter()
    for step in range(1, steps + 1):
        workload.train_step(next(stream))
        m.after_step(step)
    seconds = time.perf_counter() - begin
    m.drain()
    row: dict[str, Any] = {
        "method": m.name,
        "interval": every,
        "steps": steps,
        "seconds": seconds,
        "throughput": steps / seconds,
        "saves": m.saves,
    }
    if hasattr(m, "ckpt"):
        records = [r for r in m.ckpt.records.values() if r.status == "committed"]
        if records:
            row["stall_ms"] = 1e3 * statistics.fmean(r.stall for r in records)
            row["durable_ms"] = 1e3 * statistics.fmean(r.durable for r in records)
    shutil.rmtree(directory, ignore_errors=True)
    return row


def _spread(group: list[dict[str, Any]]) -> float:
    seconds = [g["seconds"] for g in group]
    return (max(seconds) - min(seconds)) / statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--nice", type=int, default=-10, help="CPU priority while measuring")
    parser.add_argument("--out", default=str(RESULTS / "sim_exp1_throughput_vs_interval"))
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the table and plot from the CSV"
    )
    args = parser.parse_args()
    out = Path(args.out)
    if args.report_only:
        rows = read_csv(out.with_suffix(".csv"))
        base, rows = rows[0], rows[1:]
        sys.argv.remove("--report-only")  # the files name the command that measured
    else:
        base, rows = measure(args)
        write_csv([base, *rows], out.with_suffix(".csv"), header=csv_header())
    report(args, base, rows, out)


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = Path(tempfile.mkdtemp(prefix="pcframe-exp1-", dir=Path.cwd()))
    if args.nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, args.nice)
        except PermissionError:
            print(f"could not set nice {args.nice}: measuring at normal priority")
    rows = []
    bases = []
    try:
        for every in INTERVALS:  # methods interleaved per interval: load drifts hit all
            runs: dict[str, list[dict[str, Any]]] = {}
            for _ in range(args.repeats):
                bases.append(run_once(NoCheckpoint, 10**9, args.steps, args.width, root))
                for method in METHODS:
                    row = run_once(method, every, args.steps, args.width, root)
                    runs.setdefault(row["method"], []).append(row)
            for group in runs.values():
                row = dict(min(group, key=lambda r: r["seconds"]))
                row["spread"] = _spread(group)
                rows.append(row)
                print(
                    f"k={row['interval']:3d} {row['method']:15s} {row['throughput']:6.2f} "
                    f"steps/s spread {row['spread']:.0%}",
                    flush=True,
                )
        # One baseline for all: the fastest no-checkpoint run of the whole experiment.
        base = dict(min(bases, key=lambda r: r["seconds"]))
        base["spread"] = _spread(bases)
        base["runs"] = len(bases)
        for row in rows:
            row["slowdown"] = row["seconds"] / base["seconds"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return base, rows


def report(
    args: argparse.Namespace, base: dict[str, Any], rows: list[dict[str, Any]], out: Path
) -> None:
    state_mb = build("gpt", width=args.width, layers=4).state_bytes() / 1e6
    note = (
        f"Workload: GPT-style model (width {args.width}, 4 layers), {state_mb:.1f} MB of "
        f"weights + AdamW moments, 1 training thread; {args.steps} steps per run, the fastest "
        f"of {args.repeats} runs per point. No checkpointing: **{base['throughput']:.2f} "
        f"steps/s** (fastest of {base.get('runs') or args.repeats * len(INTERVALS)} runs; "
        f"their spread "
        f"{base['spread']:.0%}). Slowdown = point's time / the fastest no-checkpoint run's "
        "time. Shared 2-core machine with other jobs running: the CSV's `spread` column is "
        "(max - min) / median of each point's runs; at k >= 10 the differences between "
        "methods are within that noise, and the k = 100 column is slower for every method "
        "(one save in 110 steps) because the machine was busier while it ran."
    )
    names = list(dict.fromkeys(r["method"] for r in rows))
    table_rows = []
    for name in names:
        cells: dict[str, Any] = {"method": name}
        for every in INTERVALS:
            r = next(r for r in rows if r["method"] == name and r["interval"] == every)
            cells[f"k={every}"] = f"{r['throughput']:.2f} ({r['slowdown']:.2f}x)"
        table_rows.append(cells)
    text = header("Experiment 1: throughput vs checkpoint interval (real engine, CPU)", note)
    text += "Throughput in steps/s (slowdown vs no checkpointing):\n\n"
    text += markdown_table(table_rows, ["method"] + [f"k={k}" for k in INTERVALS])
    pc = [dict(r) for r in rows if r.get("stall_ms") is not None]
    if pc:
        step_ms = 1e3 / base["throughput"]
        for r in pc:
            # What blocking alone would cost: the training thread waits stall_ms per save.
            r["blocked_slowdown"] = 1.0 + r["stall_ms"] / (r["interval"] * step_ms)
        text += (
            "\npcframe's own measurements (mean per committed save). `blocked_slowdown` = "
            "1 + stall / (k x step time): the slowdown the training thread's blocking alone "
            "explains. The rest of the measured slowdown at small k is the background copy, "
            "checksum and write threads competing with training for the 2 CPU cores, which a "
            "GPU job would not see:\n\n"
        )
        columns = ["method", "interval", "saves", "stall_ms", "durable_ms", "blocked_slowdown"]
        text += markdown_table(pc, columns, digits=2)
    write_results(out.with_suffix(".md"), text)
    series = {
        name: (
            [r["interval"] for r in rows if r["method"] == name],
            [r["throughput"] for r in rows if r["method"] == name],
        )
        for name in names
    }
    series["no checkpoint"] = (list(INTERVALS), [base["throughput"]] * len(INTERVALS))
    plot_lines(
        series,
        out.with_suffix(".png"),
        xlabel="checkpoint interval (iterations)",
        ylabel="training throughput (steps/s)",
        title="Throughput vs checkpoint interval (GPT-style model, CPU)",
        logx=True,
    )
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
