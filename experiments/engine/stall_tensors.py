"""The stall as the state's tensor count grows: pcframe and DefaultStager against memcpy.

``bench_engine.py`` snapshots a state of six large tensors, where any copy loop reaches
memory bandwidth. A real model's state is hundreds to thousands of tensors (a 12-layer
GPT-2 with Adam: about 600), and then what a copy costs *per tensor* decides the stall.
This script keeps the state's size fixed and cuts it into more and more tensors (a stack
of ``Linear(w, w)`` layers with Adam: eight tensors per layer, two of them 0-d step
counts), and in one process measures, with nothing between ``save()`` and the next
``optimizer.step()``:

* pcframe with its default copy stage (``copy_backend: auto``: ctypes ``memmove`` per
  piece from address tables, the GIL released for each copy);
* pcframe with ``copy_backend: numba`` (one Numba call per 16 MiB chunk, same tables);
* pcframe with ``copy_backend: torch`` (``Tensor.copy_`` per piece: the default before);
* ``dcp.async_save`` with ``DefaultStager``, waited for until ``staging_completion``;

and, just before every checkpoint, two references: one ``copy_`` of the state's bytes
between two contiguous buffers (2 threads: the memory's limit, as in ``bench_engine.py``)
and a copy of the state's tensors one ``copy_`` each into one buffer (what a per-tensor
loop costs in that second). Each stall is divided by the references timed just before it;
each method's stall by DefaultStager's median in the same round.

Run:  python experiments/engine/stall_tensors.py --out experiments/results/stall_tensors.md
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_engine import gather_seconds, spread, state_tensors
from methods import DCP, PCFrame, build_stack, loop, stall_of_one

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

METHODS = (
    "pcframe (default: auto)",
    "pcframe copy_backend=numba",
    "pcframe copy_backend=torch",
    "dcp + DefaultStager",
)
ANCHOR = METHODS[-1]


def measure(args: argparse.Namespace, layers: int, base: Path) -> dict:
    import torch

    model, optimizer = build_stack(args.size_gb, layers)
    sources = state_tensors(model, optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    into = torch.zeros(nbytes, dtype=torch.uint8)
    left, right = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)

    def memcpy() -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            right.copy_(left)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def make(name: str):
        directory = base / f"{layers}-{METHODS.index(name)}"
        directory.mkdir(parents=True)
        if name.startswith("dcp"):
            return DCP(model, optimizer, directory, "stager")
        backend = name.split("=")[1] if "=" in name else "auto"
        return PCFrame(model, optimizer, directory, max_in_flight=1, copy_backend=backend)

    methods = {name: make(name) for name in METHODS}
    for impl in methods.values():
        loop(impl, 2, 1, 0.0)  # warm-up: allocations, threads, kernels loaded
    stalls = {name: [] for name in METHODS}
    per_memcpy = {name: [] for name in METHODS}
    per_gather = {name: [] for name in METHODS}
    per_stager = {name: [] for name in METHODS}
    for r in range(args.rounds):
        medians = {}
        for name in METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]:
            impl, mine = methods[name], []
            for _ in range(args.checkpoints):
                impl.finish()  # the previous checkpoint is durable
                impl.optimizer.step()
                limit = memcpy()
                loop_copy = statistics.median(gather_seconds(sources, into))
                stall = stall_of_one(impl)
                mine.append(stall)
                per_memcpy[name].append(stall / limit)
                per_gather[name].append(stall / loop_copy)
            stalls[name] += mine
            medians[name] = statistics.median(mine)
            if name.startswith("dcp"):
                for path in impl.dir.glob("ckpt*"):
                    shutil.rmtree(path, ignore_errors=True)
        for name in METHODS:
            per_stager[name].append(medians[name] / medians[ANCHOR])
        print(
            f"{layers} layers, round {r + 1}:", {k: round(v * 1e3, 1) for k, v in medians.items()}
        )
    for impl in methods.values():
        impl.finish()
        if isinstance(impl, PCFrame):
            impl.ckpt.close()
    return {
        "state_tensors": sum(1 for _ in model.state_dict())
        + sum(len(s) for s in optimizer.state.values()),
        "nbytes": nbytes,
        "stalls": stalls,
        "per_memcpy": per_memcpy,
        "per_gather": per_gather,
        "per_stager": per_stager,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.25)
    parser.add_argument("--layers", default="1,12,100,400", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--checkpoints", type=int, default=3, help="per method per round")
    parser.add_argument("--dir", default=None, help="directory on the disk to write to")
    parser.add_argument("--out", default="experiments/results/stall_tensors.md")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(2)
    base = Path(args.dir or tempfile.mkdtemp(prefix="pcframe-tensors-", dir="/var/tmp"))
    results = {}
    try:
        for layers in (int(x) for x in args.layers.split(",")):
            results[layers] = measure(args, layers, base / str(layers))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    count = args.rounds * args.checkpoints
    command = (
        f"python experiments/engine/stall_tensors.py --size-gb {args.size_gb} "
        f"--layers {args.layers} --rounds {args.rounds} --checkpoints {args.checkpoints} "
        f"--out {args.out}"
    )
    lines = [
        *header("The stall as the state's tensor count grows", command),
        "One process per row group: a stack of `Linear(w, w)` layers with Adam moments, the "
        "same bytes cut into more tensors as the layers grow; every method in the same "
        f"process, {args.rounds} rounds of {args.checkpoints} checkpoints each (the order "
        "rotated per round), nothing between `save()` and the next `optimizer.step()`. "
        "`÷ memcpy`: each stall ÷ one `copy_` of the state's bytes between two contiguous "
        "buffers (2 threads, median of 3) timed just before it; `÷ per-tensor copy`: ÷ "
        "copying the state's tensors into one buffer, one `copy_` each, timed just before "
        f"it; median (min..max) over {count} checkpoints. `÷ DefaultStager`: each round's "
        "median ÷ DefaultStager's median in that round, median (min..max) over rounds.",
        "",
    ]
    rows = [
        [
            layers,
            res["state_tensors"],
            f"{res['nbytes'] / (1 << 30):.2f}",
            name,
            spread(res["stalls"][name], 1000, 1),
            spread(res["per_stager"][name], digits=2),
            spread(res["per_memcpy"][name], digits=2),
            spread(res["per_gather"][name], digits=2),
        ]
        for layers, res in results.items()
        for name in METHODS
    ]
    columns = ["layers", "tensors", "GiB", "method", "stall (ms)", "÷ DefaultStager"]
    columns += ["÷ memcpy", "÷ per-tensor copy"]
    lines += table_lines(columns, rows, align="rrrlrrrr")
    text = "\n".join([*lines, ""])
    write_results(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
