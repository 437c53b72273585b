"""Cold restores of every method's newest checkpoint, in rounds: paired ratios.

``bench_engine.py`` runs this once every method has saved. One process holds the live model
and optimizer; each round restores every method's checkpoint once into them ("into live
objects", as a rollback does) and once into objects built afresh ("resume", as a restarted
job does), the page cache dropped before each, the order rotated from round to round, and
reads the pcframe data file cold with plain threads (the disk's read limit in that round).

A shared machine drifts by tens of percent within a minute, more than the differences
measured: a ratio is therefore taken inside each round (method ÷ torch.load of the same
round) and the table gives the median and spread of those paired ratios, not a ratio of
medians taken minutes apart.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_engine import PCFrame, build_state, drop_caches, fresh_objects, make_method

READ_BLOCK = 16 << 20


def newest_number(directory: Path) -> int:
    """The newest ``ckptN`` a torch.save or DCP method left in ``directory``."""
    names = (re.match(r"ckpt(\d+)", p.name) for p in directory.iterdir())
    return max(int(m.group(1)) for m in names if m)


def cold_read_seconds(path: Path) -> float:
    """The fastest cold read of ``path`` by 1, 2 or 4 threads of 16 MiB buffered requests."""
    size = path.stat().st_size
    offsets = list(range(0, size, READ_BLOCK))

    def once(readers: int) -> float:
        drop_caches()
        fd = os.open(path, os.O_RDONLY)

        def reader(k: int) -> None:
            buffer = mmap.mmap(-1, READ_BLOCK)
            for offset in offsets[k::readers]:
                os.preadv(fd, [buffer], offset)

        try:
            start = time.perf_counter()
            with ThreadPoolExecutor(readers) as pool:
                list(pool.map(reader, range(readers)))
            return time.perf_counter() - start
        finally:
            os.close(fd)

    return min(once(readers) for readers in (1, 2, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--methods", required=True, help="JSON [[label, method, options, dir]]")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    model, optimizer, _ = build_state(args.size_gb)
    impls, data_file = {}, None
    for label, method, options, directory in json.loads(args.methods):
        impl = make_method(method, json.loads(options), model, optimizer, Path(directory))
        if isinstance(impl, PCFrame):
            newest = max(impl.ckpt.committed_versions())
            data_file = data_file or impl.ckpt.storage.path(newest) / "data.bin"
        else:
            impl.n = newest_number(Path(directory))
        impls[label] = impl
    labels = list(impls)
    rounds = []
    for r in range(args.rounds):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        row: dict = {"live": {}, "resume": {}}
        for label in order:
            cold = drop_caches()
            start = time.perf_counter()
            impls[label].restore(model, optimizer)
            row["live"][label] = time.perf_counter() - start
        for label in order:
            fresh_model, fresh_optimizer = fresh_objects(args.size_gb)
            drop_caches()
            start = time.perf_counter()
            impls[label].restore(fresh_model, fresh_optimizer)
            row["resume"][label] = time.perf_counter() - start
            del fresh_model, fresh_optimizer
        row["read_limit"] = cold_read_seconds(data_file) if data_file else None
        row["cold_cache"] = cold
        rounds.append(row)
        print(f"restore round {r + 1}: " + json.dumps(row))
    Path(args.json).write_text(json.dumps(rounds))


if __name__ == "__main__":
    main()
