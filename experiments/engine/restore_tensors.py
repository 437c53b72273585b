"""Cold restores as the state's tensor count grows: pcframe against torch.load and dcp.load.

``bench_engine.py`` restores a state of six large tensors, where a restore is the disk's
cold read and little else. A real model's state is hundreds to thousands of tensors, and
then what a restore costs *per tensor* (parsing, planning, checks, ``load_state_dict``)
decides it. This script keeps the state's size fixed and cuts it into more and more
tensors (the stack of ``Linear(w, w)`` layers with Adam of ``stall_tensors.py``), saves it
once with each method, and then, in rounds, restores it in fresh processes, the page cache
dropped first, the order rotated from round to round:

* pcframe ``rollback``: the process saves one checkpoint, as a training job has, then
  loads it back into its own objects (the checkpointer's staging pool idle);
* ``live``: every method, into live objects (the optimizer has its state) of a process
  that never saved: ``torch.load(weights_only=True)`` + ``load_state_dict``, ``dcp.load``
  (DCP's own ``get_state_dict`` / ``set_state_dict``), pcframe's ``restore()``;
* ``resume``: every method, into objects built afresh (no optimizer state), as a
  restarted job does.

Then the round reads pcframe's newest data file cold with plain threads (the disk's read
limit). Each ratio is taken inside a round (pcframe ÷ torch.load of the same kind in the
same round; a rollback ÷ torch.load's live restore) and the table gives their median and
spread over rounds.

Run:  python experiments/engine/restore_tensors.py --out experiments/results/restore_tensors.md
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_engine import spread
from methods import build_stack, drop_caches, make_method
from restore_rounds import newest_number, read_limit_seconds

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

# (label, method, kind): every restore a round times, each in a fresh process
RESTORES = (
    ("pcframe", "pcframe", "rollback"),
    ("pcframe", "pcframe", "live"),
    ("pcframe", "pcframe", "resume"),
    ("torch.load", "torch.save", "live"),
    ("torch.load", "torch.save", "resume"),
    ("dcp.load", "dcp.async_save", "live"),
    ("dcp.load", "dcp.async_save", "resume"),
)


def restore_once(args: argparse.Namespace) -> float:
    """In this fresh process: build the objects, drop the page cache, time one restore."""
    import torch

    torch.set_num_threads(2)
    method, kind, directory = json.loads(args.one)
    model, optimizer = build_stack(args.size_gb, args.layers, fresh=kind == "resume")
    impl = make_method(method, {}, model, optimizer, Path(directory))
    if method != "pcframe":
        impl.n = newest_number(Path(directory))
    if kind == "rollback":
        impl.save()  # the job's last checkpoint, which it goes back to
        impl.finish()
    # Building the state made some 300,000 objects: a full collection of them is due, and
    # it would land in whichever method's timed restore allocates first (130 ms). Every
    # method starts with none due, as a training process between two collections does.
    gc.collect()
    if not drop_caches():
        raise SystemExit("cannot drop the page cache (needs root): a warm restore is no anchor")
    start = time.perf_counter()
    if kind == "rollback":
        impl.rollback()
    else:
        impl.restore(model, optimizer)
    seconds = time.perf_counter() - start
    if method == "pcframe":
        impl.ckpt.close()
    return seconds


def measure(args: argparse.Namespace, layers: int, base: Path) -> dict:
    """Save once with each method, then time every restore of :data:`RESTORES` in rounds."""
    model, optimizer = build_stack(args.size_gb, layers)
    tensors = len(model.state_dict()) + sum(len(s) for s in optimizer.state.values())
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if hasattr(t, "numel")
    )
    directories = {}
    for method in dict.fromkeys(m for _, m, _ in RESTORES):
        directory = directories[method] = base / method.replace(" ", "_")
        directory.mkdir(parents=True)
        impl = make_method(method, {}, model, optimizer, directory)
        impl.save()
        impl.finish()
        if method == "pcframe":
            impl.ckpt.close()
    del model, optimizer
    rounds = []
    for r in range(args.rounds):
        order = RESTORES[r % len(RESTORES) :] + RESTORES[: r % len(RESTORES)]
        row = {}
        for label, method, kind in order:
            cmd = [sys.executable, __file__, "--size-gb", str(args.size_gb)]
            one = json.dumps([method, kind, str(directories[method])])
            cmd += ["--layers", str(layers), "--one", one]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            row[f"{label} {kind}"] = json.loads(done.stdout.strip().splitlines()[-1])
        newest = sorted(directories["pcframe"].glob("v*/data.bin"))[-1]
        row["read limit"] = read_limit_seconds(newest)
        rounds.append(row)
        print(f"{layers} layers, round {r + 1}:", {k: round(v * 1e3) for k, v in row.items()})
    return {"tensors": tensors, "nbytes": nbytes, "rounds": rounds}


def ratios(rounds: list[dict], numerator: str, denominator: str) -> list[float]:
    return [row[numerator] / row[denominator] for row in rounds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.25)
    parser.add_argument("--layers", default="1,12,100,400", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="directory on the disk to write to")
    parser.add_argument("--out", default="experiments/results/restore_tensors.md")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one restore, in a child
    args = parser.parse_args()
    if args.one:
        args.layers = int(args.layers)
        print(json.dumps(restore_once(args)))
        return

    import torch

    torch.set_num_threads(2)
    if not drop_caches():
        raise SystemExit("cannot drop the page cache (needs root): a warm restore is no anchor")
    base = Path(args.dir or tempfile.mkdtemp(prefix="pcframe-restore-", dir="/var/tmp"))
    results = {}
    try:
        for layers in (int(x) for x in args.layers.split(",")):
            results[layers] = measure(args, layers, base / str(layers))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    command = (
        f"python experiments/engine/restore_tensors.py --size-gb {args.size_gb} "
        f"--layers {args.layers} --rounds {args.rounds} --out {args.out}"
    )
    rows = []
    for layers, res in results.items():
        rounds = res["rounds"]
        for label, _, kind in RESTORES:
            name = f"{label} {kind}"
            anchor = "live" if kind == "rollback" else kind
            torch_ratio = dcp_ratio = "—"
            if label != "torch.load":
                torch_ratio = spread(ratios(rounds, name, f"torch.load {anchor}"), digits=2)
            if label != "dcp.load":
                dcp_ratio = spread(ratios(rounds, name, f"dcp.load {anchor}"), digits=2)
            rows.append(
                [
                    layers,
                    res["tensors"],
                    f"{res['nbytes'] / (1 << 30):.2f}",
                    name,
                    spread([row[name] for row in rounds], digits=3),
                    torch_ratio,
                    dcp_ratio,
                    spread(ratios(rounds, name, "read limit"), digits=2),
                ]
            )
    columns = ["layers", "tensors", "GiB", "restore", "seconds"]
    columns += ["÷ torch.load", "÷ dcp.load", "÷ read limit"]
    lines = [
        *header("Cold restores as the state's tensor count grows", command),
        "A stack of `Linear(w, w)` layers with Adam moments, the same bytes cut into more "
        "tensors as the layers grow. Every restore in a fresh process, the page cache "
        f"dropped first; {args.rounds} rounds, the order rotated per round. `rollback`: "
        "pcframe's checkpointer loads back what it saved (copied from the staging buffers "
        "that still hold it, each chunk checked against its checksum: no file read); `live`: "
        "into live objects of a process that never saved; `resume`: into objects built "
        "afresh (no optimizer state). Each child runs a full garbage collection before "
        "its timed restore (building the state leaves one due). Ratios are taken inside "
        "each round (÷ torch.load: "
        "torch.load + `load_state_dict` of the same kind, a rollback ÷ its live restore; "
        "÷ read limit: the fastest cold read of pcframe's data file by 1, 2 or 4 threads); "
        "median (min..max) over rounds.",
        "",
        *table_lines(columns, rows, align="rrrlrrrr"),
    ]
    text = "\n".join([*lines, ""])
    write_results(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
