"""What one peer copy costs in CPU time, sender and receiver (a finding of the recovery
benchmark: on its 2 cores the peer tier's overhead is CPU time the training loses).

    python experiments/recovery/peer_copy_cpu.py [--mib 132] [--rounds 12] [--out FILE]

Two gloo ranks on loopback, as the peer tier runs them: rank 0 sends a real committed shard
(saved by a :class:`~pcframe.Checkpointer`) with
:func:`~pcframe.distributed.shard_stream.send_version`, rank 1 takes each copy as
:class:`~pcframe.distributed.replication.PeerReplication` does (room in a
:class:`~pcframe.store.tiers.peer.PeerStore` of 2.5 copies, ``keep=2``; staging; receive;
commit). Two ways to receive, alternating round by round:

* ``spare``: the shipped path, the copy written over the files of the copy the store drops;
* ``fresh``: the copy written into new files (``spare=None``) and the dropped copy deleted
  when the new one is committed, what the store did before.

Each copy is timed by the CPU time (user + system, all threads) of each process and by the
wall clock; the first two rounds of each way are not counted (the store fills up).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.append(str(Path(__file__).resolve().parents[1]))  # results_file
from results_file import command_line, header, table_lines, write_results
from run_recovery import spread

from pcframe import Checkpointer
from pcframe.distributed.shard_stream import receive_version, send_version
from pcframe.store.tiers.peer import PeerStore, copy_bytes

WARM = 2  # rounds of each way not counted: the store holds fewer than `keep` copies


class _Weights:
    """A state of ``mib`` MiB of float32 (the shard's bytes; their values do not matter)."""

    def __init__(self, mib: int) -> None:
        self.tensor = torch.randn(mib << 18)

    def state_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensor.copy_(state["tensor"])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rank(rank: int, port: int, shard: str, store_dir: str, rounds: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    size = copy_bytes(Path(shard))  # what the store counts a copy as
    store = PeerStore(Path(store_dir), budget=int(2.5 * size), keep=2) if rank == 1 else None
    samples: list[tuple[str, float, float]] = []
    for i in range(2 * rounds):
        way = ("spare", "fresh")[i % 2]
        dist.barrier()
        cpu, wall = _cpu(), time.perf_counter()
        if rank == 0:
            send_version(Path(shard), 1, None)
        else:
            assert store is not None
            version = i + 1
            assert store.make_room(size)
            staging = store.staging(0, version)
            receive_version(0, staging, None, spare=store.spare if way == "spare" else None)
            store.commit(0, version, staging)
        samples.append((way, _cpu() - cpu, time.perf_counter() - wall))
    dist.barrier()
    out.put((rank, samples[2 * WARM :]))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=132, help="the shard's size (the benchmark's)")
    parser.add_argument("--rounds", type=int, default=12, help="copies of each way")
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="peer-copy-cpu-"))
    store_dir = Path(tempfile.mkdtemp(prefix="peer-copy-cpu-", dir=args.shm))
    try:
        with Checkpointer(scratch / "root", stateful={"w": _Weights(args.mib)}) as ckpt:
            ckpt.save(1).wait()
        shard = scratch / "root" / "v00000001"
        context = mp.get_context("spawn")
        results = context.Queue()
        port = _free_port()
        procs = [
            context.Process(
                target=_rank,
                args=(r, port, str(shard), str(store_dir), args.rounds, results),
            )
            for r in range(2)
        ]
        for proc in procs:
            proc.start()
        got = dict(results.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)
    rows, per_way = [], {}
    for way in ("spare", "fresh"):
        send = [c for w, c, _ in got[0] if w == way]
        receive = [c for w, c, _ in got[1] if w == way]
        wall = [t for w, _, t in got[1] if w == way]
        per_way[way] = (send, receive)
        rows.append([way, len(receive), *(spread(v, "{:.3f}") for v in (send, receive, wall))])
    ratios = [s / f for s, f in zip(per_way["spare"][1], per_way["fresh"][1], strict=False)]
    note = f"{os.cpu_count()} CPU cores, load average before {os.getloadavg()[0]:.2f}"
    lines = [
        *header("One peer copy's CPU time (two gloo ranks on loopback)", command_line(), note),
        f"A {args.mib} MiB shard sent by rank 0 and received by rank 1 into a `PeerStore` on "
        f"{args.shm} (2.5 copies of budget, `keep=2`), the two ways alternating round by round; "
        f"the first {WARM} rounds of each way not counted. Cells: median (min..max) over the "
        "copies, in seconds.",
        "",
        *table_lines(
            ["way", "copies", "sender CPU", "receiver CPU", "receiver wall"], rows, "lrrrr"
        ),
        "",
        f"* receiver CPU, spare ÷ fresh, paired per round: {spread(ratios, '{:.3f}')}x",
        "",
        "spare: the shipped path (the copy written over the files of the copy the store drops); "
        "fresh: new files, the dropped copy deleted at the commit (the store before). The sender "
        "is the same in both (its shard's files mapped and sent from the page cache).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_results(args.out, text)


if __name__ == "__main__":
    main()
