"""Where the stall goes: pcframe and DefaultStager against a copy of the same tensors.

One process holds the state (a model + Adam moments, ``--size-gb`` GiB on CPU) and both
methods: ``dcp.async_save`` with ``DefaultStager`` (waited for until ``staging_completion``)
and pcframe (one version in flight). They take turns of ``--checkpoints`` checkpoints,
alternating which goes first, with nothing between ``save()`` and the next
``optimizer.step()``. Just before every checkpoint, once the previous one is durable, the
process copies the state's tensors into one buffer (2 threads, median of 3): the floor of
any snapshot of these bytes in that second. Each stall is divided by the copy just before
it, so the ratio is paired to the second and free of the drift between processes that
``bench_engine.py`` pairs by the round.

For pcframe the script also records, from the chunks it stages, when each copying thread
(the engine's copy thread and the training thread waiting in the gate) started its first
chunk after ``save()`` was called, how long it was busy copying, and at what rate: the
stall is the copy's time once both threads run, plus the time before they start.

Run:  python experiments/engine/stall_floor.py --out experiments/results/stall_floor.md
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_engine import gather_seconds, spread, state_tensors
from methods import DCP, PCFrame, build_state, loop, stall_of_one

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results


class CopyLog:
    """Wraps the staging of each chunk (whichever kernel copies it): per thread, when it
    first copied and how long it copied."""

    def __init__(self) -> None:
        from pcframe.save.fill import Filler

        self.spans: list[tuple[str, float, float, int]] = []
        self._lock = threading.Lock()
        inner = Filler.chunk

        def chunk(filler, write, unit, buffer, flats):
            start = time.perf_counter()
            result = inner(filler, write, unit, buffer, flats)
            span = (threading.current_thread().name, start, time.perf_counter(), unit.length)
            with self._lock:
                self.spans.append(span)
            return result

        Filler.chunk = chunk

    def take(self) -> list[tuple[str, float, float, int]]:
        with self._lock:
            spans, self.spans = self.spans, []
        return spans


def record_threads(spans: list, began: float, starts: dict, busy: dict, rates: dict) -> None:
    """Per copying thread of one checkpoint: first chunk, time copying, rate."""
    for thread in {span[0] for span in spans}:
        mine = [span for span in spans if span[0] == thread]
        role = "training thread" if thread == "MainThread" else "copy thread"
        seconds = sum(end - start for _, start, end, _ in mine)
        starts.setdefault(role, []).append(min(start for _, start, _, _ in mine) - began)
        busy.setdefault(role, []).append(seconds)
        rates.setdefault(role, []).append(sum(size for *_, size in mine) / seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.47)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--checkpoints", type=int, default=3, help="per method per round")
    parser.add_argument("--dir", default=None, help="directory on the disk to write to")
    parser.add_argument("--out", default="experiments/results/stall_floor.md")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(2)
    log = CopyLog()
    model, optimizer, _ = build_state(args.size_gb)
    sources = state_tensors(model, optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    into = torch.zeros(nbytes, dtype=torch.uint8)

    def floor() -> float:
        return statistics.median(gather_seconds(sources, into))

    base = Path(args.dir or tempfile.mkdtemp(prefix="pcframe-floor-", dir="/var/tmp"))
    dcp_dir, pcf_dir = base / "dcp", base / "pcframe"
    dcp_dir.mkdir(parents=True, exist_ok=True)
    pcf_dir.mkdir(parents=True, exist_ok=True)
    methods = {
        "dcp.async_save + DefaultStager": DCP(model, optimizer, dcp_dir, "stager"),
        "pcframe {max_in_flight: 1}": PCFrame(model, optimizer, pcf_dir, max_in_flight=1),
    }
    for impl in methods.values():
        loop(impl, 1, 1, 0.0)  # warm-up: allocations, thread starts
    log.take()
    ratios: dict[str, list[float]] = {name: [] for name in methods}
    stalls: dict[str, list[float]] = {name: [] for name in methods}
    starts: dict[str, list[float]] = {}
    busy: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    names = list(methods)
    for r in range(args.rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            impl = methods[name]
            for _ in range(args.checkpoints):
                impl.finish()  # the previous checkpoint is durable
                impl.optimizer.step()
                reference = floor()
                log.take()
                began = time.perf_counter()
                stall = stall_of_one(impl)
                if isinstance(impl, PCFrame):
                    record_threads(log.take(), began, starts, busy, rates)
                stalls[name].append(stall)
                ratios[name].append(stall / reference)
            for path in dcp_dir.glob("ckpt*"):
                shutil.rmtree(path, ignore_errors=True)
        print(f"round {r + 1}:", {k: round(statistics.median(v), 3) for k, v in ratios.items()})
    methods["pcframe {max_in_flight: 1}"].ckpt.close()
    copy_rates = [nbytes / t for t in gather_seconds(sources, into, 5)]
    shutil.rmtree(base, ignore_errors=True)

    count = args.rounds * args.checkpoints
    command = (
        f"python experiments/engine/stall_floor.py --size-gb {args.size_gb} "
        f"--rounds {args.rounds} --checkpoints {args.checkpoints} --out {args.out}"
    )
    title = "Where the stall goes: pcframe and DefaultStager against a copy of the same tensors"
    lines = [
        *header(title, command),
        f"State: {nbytes / (1 << 30):.2f} GiB (model + Adam moments, fp32, CPU), both methods "
        f"in one process, {args.rounds} rounds of {args.checkpoints} checkpoints each "
        "(alternating which method goes first), nothing between `save()` and the next "
        "`optimizer.step()`. `÷ copy`: each stall ÷ a copy of the state's tensors into one "
        "buffer (2 threads, median of 3) timed just before it; median (min..max) over "
        f"{count} checkpoints.",
        "",
        *table_lines(
            ["method", "stall (s)", "÷ copy of the same tensors just before"],
            [[name, spread(stalls[name]), spread(ratios[name], digits=2)] for name in methods],
            align="lrr",
        ),
        "",
        "pcframe's two copying threads, per checkpoint (median (min..max)): when each "
        "started its first chunk after `save()` was called, how long it copied, and its "
        "rate while copying.",
        "",
        *table_lines(
            ["thread", "first chunk after save() (ms)", "copying (ms)", "rate (GB/s)"],
            [
                [
                    role,
                    spread(starts[role], 1000, 2),
                    spread(busy[role], 1000, 1),
                    spread(rates[role], 1e-9, 2),
                ]
                for role in sorted(starts)
            ],
            align="lrrr",
        ),
        "",
        f"The same copy, 2 threads, end of run: {spread(copy_rates, 1e-9, 2)} GB/s.",
    ]
    text = "\n".join([*lines, ""])
    write_results(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
