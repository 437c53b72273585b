"""Cold restores of every method's newest checkpoint, in rounds: paired ratios.

``bench_engine.py`` runs this once every method has saved. Each round restores every
method's checkpoint three ways, each restore in a fresh process of its own (a restore
leaves the allocator and page cache of its process in a state that measurably slows the
next method's), the page cache dropped first, the order rotated from round to round:

* ``rollback``: the process saves one checkpoint with its method, as a training job has,
  then loads the newest back into its own objects (a job going back to its last good
  state; pcframe's checkpointer then has its staging pool, idle);
* ``live``: into live objects (the optimizer has its state) of a process that never saved;
* ``resume``: into objects built afresh, as a restarted job does.

Then it reads the pcframe data file cold with plain threads (the disk's read limit in
that round).

A shared machine drifts by tens of percent within a minute, more than the differences
measured: a ratio is therefore taken inside each round (method ÷ torch.load of the same
round) and the table gives the median and spread of those paired ratios, not a ratio of
medians taken minutes apart.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from methods import PCFrame, build_state, drop_caches, fresh_objects, make_method

from pcframe.apps.limits import cold_read_seconds

READ_BLOCK = 16 << 20
KINDS = ("rollback", "live", "resume")


def newest_number(directory: Path) -> int:
    """The newest ``ckptN`` a torch.save or DCP method left in ``directory``."""
    names = (re.match(r"ckpt(\d+)", p.name) for p in directory.iterdir())
    return max(int(m.group(1)) for m in names if m)


def read_limit_seconds(path: Path) -> float:
    """The fastest cold read of ``path`` by 1, 2 or 4 threads of 16 MiB buffered requests."""
    size = path.stat().st_size
    return min(cold_read_seconds(path, size, readers, READ_BLOCK) for readers in (1, 2, 4))


def restore_once(args: argparse.Namespace) -> float:
    """In this fresh process: build the objects, drop the page cache, time one restore."""
    import torch

    torch.set_num_threads(2)
    _, method, options, directory = json.loads(args.one)
    if args.kind in ("live", "rollback"):
        model, optimizer, _ = build_state(args.size_gb)  # the optimizer has its state
    else:
        model, optimizer = fresh_objects(args.size_gb)  # as a restarted job builds them
    impl = make_method(method, json.loads(options), model, optimizer, Path(directory))
    if not isinstance(impl, PCFrame):
        impl.n = newest_number(Path(directory))
    if args.kind == "rollback":
        impl.save()  # the job's last checkpoint, which it goes back to
        impl.finish()
    if not drop_caches():
        raise SystemExit("cannot drop the page cache (needs root): a warm restore is no anchor")
    start = time.perf_counter()
    if args.kind == "rollback":
        impl.rollback()
    else:
        impl.restore(model, optimizer)
    seconds = time.perf_counter() - start
    if args.kind == "rollback" and not isinstance(impl, PCFrame):
        impl.prune()  # the next rounds read the newest checkpoint: the one just saved
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, required=True)
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--methods", help="JSON [[label, method, options, dir]]")
    parser.add_argument("--json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one restore, in a child
    parser.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(restore_once(args)))
        return
    methods = json.loads(args.methods)

    def newest_pcframe_data() -> Path | None:
        """pcframe's newest data file (a rollback commits a new version each round)."""
        for _, method, _, directory in methods:
            versions = sorted(Path(directory).glob("v*/data.bin"))
            if method == "pcframe" and versions:
                return versions[-1]
        return None

    rounds = []
    for r in range(args.rounds):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        row: dict = {kind: {} for kind in KINDS}
        for kind in KINDS:
            for entry in order:
                cmd = [sys.executable, __file__, "--size-gb", str(args.size_gb)]
                cmd += ["--one", json.dumps(entry), "--kind", kind]
                done = subprocess.run(cmd, check=True, capture_output=True, text=True)
                row[kind][entry[0]] = json.loads(done.stdout.strip().splitlines()[-1])
        data_file = newest_pcframe_data()
        row["read_limit"] = read_limit_seconds(data_file) if data_file else None
        row["cold_cache"] = True
        rounds.append(row)
        print(f"restore round {r + 1}: " + json.dumps(row), flush=True)
    Path(args.json).write_text(json.dumps(rounds))


if __name__ == "__main__":
    main()
