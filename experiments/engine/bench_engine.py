"""Engine benchmark: pcframe against the 2026 anchors, and against the machine's limits.

The same state (a model + Adam moments, about ``--size-gb`` GiB on CPU) is checkpointed by
each method in its own fresh process (so peak memory is per method):

* ``torch.save`` (+ fsync), restored by ``torch.load(weights_only=True)`` + ``load_state_dict``
  (the restore anchor);
* ``dcp.save``; ``dcp.async_save`` as it was in 2024 (a staging copy inside the call);
* ``dcp.async_save`` with ``DefaultStager`` (torch >= 2.9: background staging into buffers it
  reuses; the training loop waits for ``staging_completion`` before ``optimizer.step()``, as
  its tutorial says; pinned memory on CUDA): the stall anchor;
* pcframe with one and two versions in flight (the defaults otherwise).

With no compute, each checkpoint starts once the previous one is durable, so its stall is
the snapshot alone (for DefaultStager: ``async_save`` until ``staging_completion``).

Per method, after one warm-up checkpoint: stall (seconds the training thread is blocked per
checkpoint) in two loops, one with **no compute** between ``save()`` and the next
``optimizer.step()`` (the worst case: nothing to overlap the copy with) and one with an idle
iteration of ``--iteration-ms`` (accelerator compute leaves the CPU free); time to durable;
peak extra host memory (RSS high-water mark over the resident state). Then ``--restores``
rounds of cold restores of every method's newest checkpoint, each in a fresh process, paired
within each round (``restore_rounds.py``). Every number is a median with its min..max.

In the same run, the limits (:mod:`pcframe.apps.limits`): one memcpy of the state's bytes
and the disk's synced O_DIRECT write rate with 1 and 4 writers. The table gives each method's
ratios to them and to the anchors.

Run:  python experiments/engine/bench_engine.py --size-gb 0.47 \
          --out experiments/results/engine_cpu.md
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

METHODS = [
    ("no checkpoint", "{}"),  # the training loop alone: its own peak memory (Adam's temporaries)
    ("torch.save", "{}"),
    ("dcp.save", "{}"),
    ("dcp.async_save (2024)", "{}"),
    ("dcp.async_save + DefaultStager", "{}"),
    ("pcframe", '{"max_in_flight": 1}'),
    ("pcframe", '{"max_in_flight": 2}'),
]


# --- inside each method's process -----------------------------------------------------------


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def build_model(size_gb: float):
    import torch

    width = 4096
    per_layer = width * width + width
    layers = max(1, round(size_gb * (1 << 30) / 12 / per_layer))  # weights + 2 Adam moments
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def fresh_objects(size_gb: float):
    """A model and an optimizer as a resumed job builds them: weights set, no Adam state."""
    import torch

    with torch.device("meta"):
        model = build_model(size_gb)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.zero_()  # touched, like initialised weights
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def build_state(size_gb: float):
    import torch

    torch.manual_seed(0)
    model = build_model(size_gb)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # materialise the moments
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return model, optimizer, nbytes


class Method:
    """One way to checkpoint: ``save`` returns the stall; ``durables`` collects durations."""

    def __init__(self, model, optimizer, directory: Path) -> None:
        self.model, self.optimizer, self.dir, self.n = model, optimizer, directory, 0
        self.durables: list[float] = []

    def state(self):
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def save(self) -> float:
        raise NotImplementedError

    def finish(self) -> None:
        """Wait for everything in flight."""

    def restore(self, model, optimizer) -> None:
        """Load the newest checkpoint into ``model`` and ``optimizer``."""
        raise NotImplementedError

    def prune(self) -> None:
        """Delete every checkpoint but the newest (pcframe's retention does it itself)."""
        for path in self.dir.glob("ckpt*"):
            if path.name not in (f"ckpt{self.n}", f"ckpt{self.n}.pt"):
                shutil.rmtree(path) if path.is_dir() else path.unlink()


class NoCheckpoint(Method):
    def save(self) -> float:
        return 0.0

    def restore(self, model, optimizer) -> None:
        raise RuntimeError("nothing to restore")


class TorchSave(Method):
    def save(self) -> float:
        import torch

        start = time.perf_counter()
        self.n += 1
        with open(self.dir / f"ckpt{self.n}.pt", "wb") as f:
            torch.save(self.state(), f)
            f.flush()
            os.fsync(f.fileno())
        self.durables.append(time.perf_counter() - start)
        return self.durables[-1]

    def restore(self, model, optimizer) -> None:
        import torch

        state = torch.load(self.dir / f"ckpt{self.n}.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])


class DCP(Method):
    def __init__(self, model, optimizer, directory: Path, mode: str) -> None:
        super().__init__(model, optimizer, directory)
        self.mode, self.pending, self.started = mode, None, 0.0
        self.stager = None
        if mode == "stager":
            import torch
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pinned = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(pinned, pinned, True, pinned))

    def state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # DCP's own way (fully qualified names): what its load below reads back.
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def save(self) -> float:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        self.finish()  # one async save at a time (torchtitan waits the same way): stall too
        self.n += 1
        path = str(self.dir / f"ckpt{self.n}")
        self.started = time.perf_counter()
        if self.mode == "sync":
            dcp.save(self.state(), checkpoint_id=path)
            self.durables.append(time.perf_counter() - self.started)
        elif self.mode == "async":
            self.pending = dcp.async_save(self.state(), checkpoint_id=path)
        else:
            response = dcp.async_save(self.state(), checkpoint_id=path, async_stager=self.stager)
            response.staging_completion.result()  # before optimizer.step(), per the tutorial
            self.pending = response.upload_completion
        return time.perf_counter() - start

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.durables.append(time.perf_counter() - self.started)
            self.pending = None

    def restore(self, model, optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        # DCP's own way: state dicts it can load into (optimizer state created if missing).
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(self.dir / f"ckpt{self.n}"))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


class PCFrame(Method):
    def __init__(self, model, optimizer, directory: Path, **options) -> None:
        from pcframe import Checkpointer

        super().__init__(model, optimizer, directory)
        self.ckpt = Checkpointer(directory, model=model, optimizer=optimizer, **options)
        self.seen: set[int] = set()

    def save(self) -> float:
        self.n += 1
        self.ckpt.save(self.n)
        return float("nan")  # taken from the engine's records: save() + the gate

    def finish(self) -> None:
        self.ckpt.wait()

    def stalls_and_durables(self, since: int) -> tuple[list[float], list[float]]:
        self.finish()
        records = [r for v, r in sorted(self.ckpt.records.items()) if v > since]
        return [r.stall for r in records], [r.durable for r in records]

    def restore(self, model, optimizer) -> None:
        from pcframe import Checkpointer

        self.ckpt.close()
        with Checkpointer(self.dir, model=model, optimizer=optimizer) as ckpt:
            ckpt.restore()


def make_method(name: str, options: dict, model, optimizer, directory: Path) -> Method:
    if name == "no checkpoint":
        return NoCheckpoint(model, optimizer, directory)
    if name == "torch.save":
        return TorchSave(model, optimizer, directory)
    if name.startswith("dcp"):
        mode = "sync" if name == "dcp.save" else "stager" if "Stager" in name else "async"
        return DCP(model, optimizer, directory, mode)
    return PCFrame(model, optimizer, directory, **options)


def loop(impl: Method, checkpoints: int, every: int, iteration: float) -> dict:
    """Train ``checkpoints * every`` steps, checkpointing every ``every``: stalls, durables."""
    since, stalls = impl.n, []
    impl.durables = []
    for step in range(1, checkpoints * every + 1):
        if iteration:
            time.sleep(iteration)  # forward/backward on an accelerator: the CPU is free
        impl.optimizer.step()  # pcframe's gate waits here (in its records' stall)
        if step % every == 0:
            if not iteration:
                impl.finish()  # the snapshot alone is measured, not the previous write
            stalls.append(impl.save())
            if not iteration:
                impl.optimizer.step()  # at once: nothing to overlap the snapshot with
    impl.finish()
    durables = impl.durables
    if isinstance(impl, PCFrame):
        stalls, durables = impl.stalls_and_durables(since)
    return {"stalls": stalls, "durables": durables}


def run_method(args: argparse.Namespace) -> dict:
    import torch

    from pcframe.apps.limits import copy_times

    torch.set_num_threads(2)
    model, optimizer, nbytes = build_state(args.size_gb)
    # Imports and construction before the baseline: peak extra memory is what checkpointing
    # holds (staging, cached copies, buffers), not the size of a library's code.
    impl = make_method(args.method, json.loads(args.options), model, optimizer, Path(args.dir))
    # One memcpy of the state in this process, before and after its loops: the stall's
    # "÷ memcpy" compares numbers from the same minute (bandwidth drifts 20-36 GB/s here).
    memcpy = copy_times(nbytes, 3)[0]
    baseline = rss_bytes()
    reset_peak()
    loop(impl, 1, 1, 0.0)  # warm-up: first-time allocations, imports, thread starts
    idle = loop(impl, args.checkpoints, 1, 0.0)
    overlap = loop(impl, args.checkpoints, args.every, args.iteration_ms / 1000)
    peak_extra = rss_bytes("VmHWM") - baseline
    memcpy += copy_times(nbytes, 3)[0]
    impl.finish()
    impl.prune()  # the restore rounds read only the newest checkpoint: free the disk
    return {
        "bytes": nbytes,
        "idle": idle,
        "overlap": overlap,
        "peak_extra_bytes": peak_extra,
        "memcpy": memcpy,
    }


# --- the parent: limits, one process per method, the table ---------------------------------


def spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    if not values:
        return "—"
    med = statistics.median(values) * scale
    return f"{med:.{digits}f} ({min(values) * scale:.{digits}f}..{max(values) * scale:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.47)
    parser.add_argument("--checkpoints", type=int, default=5, help="measured per loop")
    parser.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    parser.add_argument("--iteration-ms", type=float, default=300.0)
    parser.add_argument("--restores", type=int, default=5, help="rounds of cold restores")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument("--out", default="experiments/results/engine_cpu.md")
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.method:
        Path(args.json).write_text(json.dumps(run_method(args)))
        return

    import torch

    from pcframe.apps.limits import measure_limits

    torch.set_num_threads(2)
    base = Path(args.dir or tempfile.mkdtemp(prefix="pcframe-bench-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    nbytes = build_state_bytes(args.size_gb)
    limits = [measure_limits(base, nbytes, repeats=3)]
    results, restorable = [], []
    for i, (method, options) in enumerate(METHODS):
        directory = base / f"run{i}"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        out = base / "result.json"
        cmd = [sys.executable, __file__, "--method", method, "--options", options]
        cmd += ["--json", str(out), "--dir", str(directory), "--size-gb", str(args.size_gb)]
        cmd += ["--checkpoints", str(args.checkpoints), "--every", str(args.every)]
        cmd += ["--iteration-ms", str(args.iteration_ms)]
        subprocess.run(cmd, check=True)
        result = json.loads(out.read_text())
        result["method"] = label = method if method != "pcframe" else f"pcframe {options}"
        results.append(result)
        print(label, json.dumps(result["idle"]))
        if method != "no checkpoint":
            restorable.append([label, method, options, str(directory)])
        limits.append(measure_limits(base, nbytes, repeats=1))
    # Restores in rounds over every method's newest checkpoint, a process each (paired).
    rounds_json = base / "rounds.json"
    cmd = [sys.executable, str(Path(__file__).with_name("restore_rounds.py"))]
    cmd += ["--size-gb", str(args.size_gb), "--rounds", str(args.restores)]
    cmd += ["--methods", json.dumps(restorable), "--json", str(rounds_json)]
    subprocess.run(cmd, check=True)
    rounds = json.loads(rounds_json.read_text())
    shutil.rmtree(base, ignore_errors=True)
    write_table(args, results, limits, rounds)


def build_state_bytes(size_gb: float) -> int:
    width = 4096
    per_layer = width * width + width
    layers = max(1, round(size_gb * (1 << 30) / 12 / per_layer))
    return layers * per_layer * 12


def write_table(args, results: list[dict], limits: list, rounds: list[dict]) -> None:
    from pcframe.apps.limits import MachineLimits, Throughput

    nbytes = results[0]["bytes"]

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
    by = {r["method"]: r for r in results}
    med = statistics.median
    stager_run = by["dcp.async_save + DefaultStager"]
    stager = med(stager_run["idle"]["stalls"])
    stager_own = stager / med(stager_run["memcpy"])  # its stall in its own process's memcpys
    gib = 1 << 30
    lines = [
        "# Engine benchmark (CPU): pcframe vs the 2026 anchors and the machine's limits",
        "",
        "Command: `python experiments/engine/bench_engine.py "
        f"--size-gb {args.size_gb} --checkpoints {args.checkpoints} --every {args.every} "
        f"--iteration-ms {args.iteration_ms:g} --restores {args.restores} --out {args.out}`",
        "",
        f"State: {nbytes / gib:.2f} GiB (model + Adam moments, fp32, CPU), one process per "
        f"method, one warm-up checkpoint each, then {args.checkpoints} measured per loop. "
        "Numbers are medians (min..max).",
        "",
        "Limits, same run (median over the run, min..max):",
        *[f"- {line}" for line in lim.lines()],
        f"- so one memcpy of the state takes {memcpy_s:.3f} s and the disk needs "
        f"{disk_s:.3f} s to make it durable; reading it back cold takes at least "
        f"{lim.read_seconds(nbytes):.3f} s",
        "",
        "## Stall with nothing to overlap (save(), then optimizer.step() at once)",
        "",
        "`÷ memcpy (run)`: ÷ one memcpy of the state at the run's median rate; `÷ memcpy "
        "(its process)`: ÷ the median of six copies timed in the method's own process just "
        "before and after its loops (the same minute, so the machine's drift cancels); the "
        "column after it divides that by DefaultStager's own.",
        "",
        "| method | stall (s) | ÷ DefaultStager | ÷ memcpy (run) | ÷ memcpy (its process) | "
        "÷ DefaultStager, both ÷ own memcpy | time to durable (s) | durable rate ÷ disk limit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r["method"] == "no checkpoint":
            continue
        stalls, durables = r["idle"]["stalls"], r["idle"]["durables"]
        rate = nbytes / med(durables) / lim.disk_write.median
        own = med(stalls) / med(r["memcpy"])
        lines.append(
            f"| {r['method']} | {spread(stalls)} | {med(stalls) / stager:.2f} | "
            f"{med(stalls) / memcpy_s:.2f} | {own:.2f} | {own / stager_own:.2f} | "
            f"{spread(durables, digits=2)} | {rate:.2f} |"
        )
    baseline_peak = by["no checkpoint"]["peak_extra_bytes"]
    lines += [
        "",
        f"## With {args.iteration_ms:g} ms of idle CPU per step (accelerator compute), a "
        f"checkpoint every {args.every} steps; host memory",
        "",
        "| method | stall (ms) | time to durable (s) | peak extra host mem (GiB) | "
        "above the loop alone (GiB) | ÷ state size |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r["method"] == "no checkpoint":
            lines.append(
                f"| no checkpoint (the loop alone) | — | — | {baseline_peak / gib:.2f} | — | — |"
            )
            continue
        stalls, durables = r["overlap"]["stalls"], r["overlap"]["durables"]
        above = r["peak_extra_bytes"] - baseline_peak
        lines.append(
            f"| {r['method']} | {spread(stalls, 1000, 1)} | {spread(durables, digits=2)} | "
            f"{r['peak_extra_bytes'] / gib:.2f} | {above / gib:.2f} | {above / nbytes:.2f} |"
        )
    labels = list(rounds[0]["live"])

    def times(kind: str, label: str) -> list[float]:
        return [r[kind][label] for r in rounds]

    def paired(kind: str, label: str, anchor: str) -> str:
        """Median (min..max) over rounds of label ÷ anchor, both timed in the same round."""
        ratios = [r[kind][label] / r[kind][anchor] for r in rounds]
        return spread(ratios, digits=2)

    read_limits = [r["read_limit"] for r in rounds if r["read_limit"]]
    lines += [
        "",
        "## Cold restore (page cache "
        + ("dropped" if all(r["cold_cache"] for r in rounds) else "warm: could not drop it")
        + " before each)",
        "",
        f"{len(rounds)} rounds (`restore_rounds.py`): each round restores every "
        "method's newest checkpoint into the live objects (the optimizer already has its "
        "state, as in a rollback) and as a resumed job does (a model built afresh and an "
        "optimizer without state), each restore in a fresh process of its own, in an order "
        "rotated per round, then reads pcframe's data "
        "file cold with plain threads (the disk's read limit, best of 1/2/4 readers × 16 MiB, "
        f"this run: {spread(read_limits, digits=3)} s). Ratios are paired: each round's time "
        "÷ the anchor's in the same round, median (min..max) over rounds.",
        "",
        "| method | into live objects (s) | ÷ torch.load | ÷ dcp.load | resume (s) | "
        "÷ torch.load | ÷ dcp.load | resume ÷ read limit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in labels:
        to_limit = [r["resume"][label] / r["read_limit"] for r in rounds if r["read_limit"]]
        lines.append(
            f"| {label} | {spread(times('live', label), digits=2)} | "
            f"{paired('live', label, 'torch.save')} | {paired('live', label, 'dcp.save')} | "
            f"{spread(times('resume', label), digits=2)} | "
            f"{paired('resume', label, 'torch.save')} | {paired('resume', label, 'dcp.save')} | "
            f"{spread(to_limit, digits=2)} |"
        )
    lines += [
        "",
        "torch.load's rows are `torch.load(weights_only=True)` + `load_state_dict` of both; "
        "dcp.load's are `get_state_dict` + `dcp.load` + `set_state_dict`; pcframe verifies "
        "every chunk's checksum and reads straight into the live tensors where they exist. "
        "Peak extra memory is the RSS high-water mark above the resident state after the "
        "method's imports and set-up; the loop alone (Adam's temporaries) is the first row, "
        "and the column after it is what checkpointing holds on top (DefaultStager caches a "
        "full staged copy; pcframe's staging pool is one version, `staging_ratio: 1.0`).",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
