"""The snapshot copy in 8-byte words against byte by byte, paired in one process.

The copy stage gathers byte ranges of the state's tensors into staging buffers through
uint8 views; torch copies uint8 elements slower than int64 ones, so the torch reference
copies in words where both ends are word-aligned (``pcframe.kernels._tensor_bytes.
copy_bytes``). Two measurements, each alternating the two ways per repeat:

* the torch reference gather of every chunk of the state's layout into a staging pool of
  distinct (cold) buffers, one thread: the copy alone;
* pcframe's stall (its record) when ``optimizer.step()`` follows ``save()`` at once, two
  threads: what training waits for.

    python experiments/engine/copy_words.py --size-gb 0.47 --repeats 20
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
from methods import build_state

import pcframe.kernels._tensor_bytes as tensor_bytes
import pcframe.kernels.copy.reference as reference
from pcframe import Checkpointer
from pcframe.format.layout import Layout
from pcframe.kernels.copy import make_plan


def byte_by_byte(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    dst.copy_(src, non_blocking=non_blocking)


WAYS = {"words": tensor_bytes.copy_bytes, "bytes": byte_by_byte}


def gather_times(model, optimizer, repeats: int, chunk: int) -> dict[str, list[float]]:
    named = [(f"model/{i}", p.detach()) for i, p in enumerate(model.parameters())]
    for i, state in enumerate(optimizer.state.values()):
        named += [(f"optimizer/{i}/{k}", v) for k, v in state.items() if v.numel() > 1]
    layout = Layout.build(named, chunk, 64)
    flats = [t.reshape(-1).view(torch.uint8) for _, t in named]
    pool = torch.zeros(len(layout.chunks) * chunk, dtype=torch.uint8)
    buffers = list(pool.split(chunk))
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(repeats):
        for way in sorted(WAYS, reverse=bool(r % 2)):
            reference.copy_bytes = WAYS[way]
            start = time.perf_counter()
            for c, buffer in zip(layout.chunks, buffers, strict=False):
                pieces = [(flats[p.entry], p.src_start, p.dst_start, p.nbytes) for p in c.pieces]
                view = buffer[: c.length]
                reference.gather(make_plan(pieces, view, scatter=False), view, zero_fill=True)
            times[way].append(time.perf_counter() - start)
    reference.copy_bytes = tensor_bytes.copy_bytes
    return times


def stall_times(model, optimizer, repeats: int) -> dict[str, list[float]]:
    versions: dict[str, list[int]] = {w: [] for w in WAYS}
    directory = tempfile.mkdtemp(prefix="pcframe-words-")
    try:
        with Checkpointer(
            directory, model=model, optimizer=optimizer, max_in_flight=1, keep_last=1
        ) as ckpt:
            ckpt.save(0).wait()
            for r in range(repeats):
                for way in sorted(WAYS, reverse=bool(r % 2)):
                    reference.copy_bytes = WAYS[way]
                    for p in model.parameters():
                        p.grad = torch.zeros_like(p)
                    handle = ckpt.save(len(ckpt.records))
                    optimizer.step()  # gated until the snapshot is copied
                    handle.wait()
                    versions[way].append(handle.version)
            ckpt.wait()  # reports every finished version into its record
            times = {w: [ckpt.records[v].stall for v in vs] for w, vs in versions.items()}
    finally:
        reference.copy_bytes = tensor_bytes.copy_bytes
        shutil.rmtree(directory, ignore_errors=True)
    return times


def report(what: str, times: dict[str, list[float]], nbytes: int) -> None:
    words, bytes_ = times["words"], times["bytes"]
    ratios = sorted(w / b for w, b in zip(words, bytes_, strict=True))
    print(
        f"{what}: words {statistics.median(words) * 1e3:.1f} ms, "
        f"bytes {statistics.median(bytes_) * 1e3:.1f} ms "
        f"({nbytes / statistics.median(words) / 1e9:.2f} vs "
        f"{nbytes / statistics.median(bytes_) / 1e9:.2f} GB/s); paired words / bytes "
        f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}..{ratios[-1]:.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.47)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    model, optimizer, nbytes = build_state(args.size_gb)
    torch.set_num_threads(1)
    report(
        "gather, 1 thread, cold buffers",
        gather_times(model, optimizer, args.repeats, 16 << 20),
        nbytes,
    )
    torch.set_num_threads(2)
    report("pcframe stall, 2 threads", stall_times(model, optimizer, args.repeats), nbytes)


if __name__ == "__main__":
    main()
