"""Bandwidth of the pcframe kernels against a plain memcpy of the same bytes, same run.

CPU (always): Numba kernels vs ``np.copyto`` into a preallocated buffer (one thread,
like the kernels); writes ``experiments/results/kernels_cpu.md``. CUDA (when present):
Triton copy into pinned host memory vs a pinned ``cudaMemcpyAsync``, and quantization
vs a device-to-device copy (HBM bandwidth); writes ``experiments/results/kernels_gpu.md``.

Each kernel is timed interleaved with its baseline (baseline, kernel, baseline, ...);
the ratio is the median of the paired ratios, so load from other users of a shared
machine mostly cancels (the absolute GB/s are best-of and less reliable there).
Outputs are preallocated where the API takes ``out=`` (a checkpoint engine reuses its
buffers; fresh allocations add page faults). Run from the repository root:

    python experiments/kernels/bench_kernels.py [--size-mib 128] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import torch

from pcframe.format.layout import Layout
from pcframe.kernels import (
    MappedFile,
    ShuffleZstd,
    checksum,
    dequantize_blockwise,
    encode_delta,
    gather,
    gather_checksum,
    persist_chunk_mmap,
    quantize_blockwise,
    shuffle_bytes,
)

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

RESULTS = Path(__file__).resolve().parents[1] / "results"
CHUNK = 16 << 20  # engine-like chunk size
Sync = Callable[[], None]


@dataclass
class Row:
    name: str
    nbytes: int
    seconds: float  # best run
    baseline: str
    baseline_gbps: float  # best baseline run
    ratio: float  # median over runs of (kernel GB/s / baseline GB/s of the adjacent run)
    target: float | None = None
    note: str = ""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


class Bench:
    """Times kernels interleaved with a baseline copy of ``size`` bytes."""

    def __init__(
        self, baseline: Callable[[], object], size: int, name: str, repeats: int, sync: Sync
    ):
        self.baseline, self.size, self.name = baseline, size, name
        self.repeats, self.sync = repeats, sync
        self.rows: list[Row] = []

    def _time(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def run(
        self,
        name: str,
        fn: Callable[[], object],
        nbytes: int,
        target: float | None = None,
        note: str = "",
        repeats: int | None = None,
    ) -> None:
        fn()  # warm-up: JIT compile or cache load, first-touch page faults
        base, kern = [], []
        for _ in range(repeats or self.repeats):
            base.append(self._time(self.baseline))
            kern.append(self._time(fn))
        # Each kernel run is compared with the baseline run right before it, so load
        # from other users of the machine mostly cancels; the median drops outliers.
        pairs = zip(base, kern, strict=True)
        ratio = float(np.median([(nbytes / k) / (self.size / b) for b, k in pairs]))
        base_gbps = self.size / min(base) / 1e9
        self.rows.append(Row(name, nbytes, min(kern), self.name, base_gbps, ratio, target, note))


def transformer_like(total: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    """fp32 tensors shaped like a transformer's parameters, ``total`` bytes in all."""
    d = 512
    per_layer = [(d, 3 * d), (3 * d,), (d, d), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    per_layer += [(d,)] * 4  # two layer norms
    layer_bytes = 4 * sum(int(np.prod(s)) for s in per_layer)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max(1, total // layer_bytes)):
        out += [(torch.randn(s, generator=g) * 0.02).to(device) for s in per_layer]
    return out


@dataclass
class Staged:
    """Tensors in the engine's layout (planned once), cut into ``CHUNK``-byte chunks."""

    layout: Layout
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.layout.data_size


def layout_of(tensors: list[torch.Tensor], align: int = 64) -> Staged:
    named = [(str(i), t) for i, t in enumerate(tensors)]
    return Staged(Layout.build(named, CHUNK, align), tensors)


def per_chunk(staged: Staged, dst: torch.Tensor, fn: Callable) -> list:
    """``fn(pieces, chunk_view)`` per chunk, the pieces bound to the tensors as the engine does."""
    out = []
    for chunk in staged.layout.chunks:
        pieces = [
            (staged.tensors[p.entry], p.src_start, p.dst_start, p.nbytes) for p in chunk.pieces
        ]
        out.append(fn(pieces, dst[chunk.offset : chunk.offset + chunk.length]))
    return out


def chunked_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """np.copyto chunk by chunk, the way the engine moves bytes."""
    for o in range(0, src.size, CHUNK):
        np.copyto(dst[o : o + CHUNK], src[o : o + CHUNK])


def cpu_rows(size: int, repeats: int) -> list[Row]:
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros_like(src)
    bench = Bench(lambda: chunked_copy(dst, src), size, "memcpy", repeats, lambda: None)
    bench.run(
        f"memcpy (np.copyto per {CHUNK >> 20} MiB, 1 thread)", lambda: chunked_copy(dst, src), size
    )
    bench.run(
        "memcpy, one call",
        lambda: np.copyto(dst, src),
        size,
        note="glibc uses non-temporal stores above a size threshold (114 MiB on this box)",
    )
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    bench.run(f"torch copy_ ({torch.get_num_threads()} threads)", lambda: tdst.copy_(tsrc), size)

    tensors = transformer_like(size, "cpu")
    layout = layout_of(tensors)
    total = layout.nbytes
    stage = torch.zeros(total, dtype=torch.uint8)
    note = f"{len(tensors)} fp32 tensors, {CHUNK >> 20} MiB chunks"
    for backend, target in (("numba", 0.8), ("torch", None)):
        fn = lambda b=backend: per_chunk(layout, stage, lambda p, d: gather(p, d, backend=b))  # noqa: E731
        bench.run(f"gather [{backend}]", fn, total, target, note)

    def fused() -> list:
        return per_chunk(
            layout, stage, lambda p, d: gather_checksum(p, d, backend="numba").result()
        )

    bench.run("gather + pcf64 fused [numba]", fused, total, 0.6, note)
    two_pass = lambda: per_chunk(  # noqa: E731
        layout, stage, lambda p, d: (gather(p, d, backend="numba"), checksum(d, "crc32c"))
    )
    bench.run("gather [numba] + crc32c (2 passes)", two_pass, total, None, note)

    for algo in ("pcf64", "crc32c", "xxh3_64"):
        where = "numba" if algo == "pcf64" else "library"
        bench.run(f"checksum {algo} [{where}]", lambda a=algo: checksum(src, a), size)

    x32 = torch.randn(size // 4, generator=torch.Generator().manual_seed(1)) * 0.01
    n_blocks = -(-x32.numel() // 256)
    qout = (torch.zeros(x32.numel(), dtype=torch.uint8), torch.zeros(n_blocks))
    deq = torch.zeros_like(x32)
    for fmt in ("int8", "fp8_e4m3"):
        fn = lambda f=fmt: quantize_blockwise(x32, f, 256, backend="numba", out=qout)  # noqa: E731
        bench.run(f"quantize {fmt}, fp32 in [numba]", fn, size, 0.5, "block 256; bytes = input")
        q = quantize_blockwise(x32, fmt, 256, backend="numba")
        bench.run(
            f"dequantize {fmt} to fp32 [numba]",
            lambda q=q: dequantize_blockwise(q, backend="numba", out=deq),
            size,
            note="bytes = output",
        )
    xbf = x32.to(torch.bfloat16)
    qbf = (qout[0][: xbf.numel()], qout[1])
    for fmt in ("int8", "fp8_e4m3"):
        fn = lambda f=fmt: quantize_blockwise(xbf, f, 256, backend="numba", out=qbf)  # noqa: E731
        bench.run(
            f"quantize {fmt}, bf16 in [numba]", fn, size // 2, 0.5, "block 256; bytes = input"
        )
    bench.run(
        "quantize int8, fp32 in [torch]",
        lambda: quantize_blockwise(x32, "int8", 256, backend="torch", out=qout),
        size,
        repeats=max(1, repeats // 3),
    )

    prev = x32 + 1e-4
    dout = torch.zeros(size, dtype=torch.uint8)
    bench.run("XOR delta [numba]", lambda: encode_delta(x32, prev, backend="numba", out=dout), size)
    bench.run(
        "byte shuffle fp32 [numba]", lambda: shuffle_bytes(x32, backend="numba", out=dout), size
    )
    small = x32[: min(x32.numel(), (64 << 20) // 4)]
    for level in (1, 3):
        codec = ShuffleZstd(level)
        ratio = small.numel() * 4 / len(codec.compress(small))
        bench.run(
            f"shuffle + zstd level {level} (1 thread)",
            lambda c=codec: c.compress(small),
            small.numel() * 4,
            note=f"ratio {ratio:.2f} on N(0, 0.01) fp32",
            repeats=max(1, repeats // 3),
        )

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    with tempfile.NamedTemporaryFile(dir=shm) as f, MappedFile(f.name, size) as region:
        region.array[:] = 0  # pre-fault: a slot file is reused across checkpoints
        chunks = [(o, src[o : o + CHUNK]) for o in range(0, size, CHUNK)]

        def into_mapping() -> None:
            for o, c in chunks:
                np.copyto(region.array[o : o + len(c)], c)

        rows_before_mmap = bench.rows
        bench = Bench(into_mapping, size, "memcpy into mmap", repeats, lambda: None)
        bench.run(f"memcpy into mmap ({shm})", into_mapping, size)
        bench.run(
            f"persist_chunk_mmap, pcf64 fused ({shm})",
            lambda: [persist_chunk_mmap(region, o, c) for o, c in chunks],
            size,
            0.6,
        )
        bench.run(
            f"persist_chunk_mmap, crc32c ({shm})",
            lambda: [persist_chunk_mmap(region, o, c, algo="crc32c") for o, c in chunks],
            size,
        )
    return rows_before_mmap + bench.rows


def gpu_rows(size: int, repeats: int) -> list[Row]:
    sync = torch.cuda.synchronize
    dev = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    pinned = torch.zeros(size, dtype=torch.uint8).pin_memory()

    def d2h_copy() -> None:
        for o in range(0, size, CHUNK):
            pinned[o : o + CHUNK].copy_(dev[o : o + CHUNK], non_blocking=True)

    d2h = Bench(d2h_copy, size, "pinned memcpy", repeats, sync)
    d2h.run(f"cudaMemcpyAsync D2H into pinned, per {CHUNK >> 20} MiB", d2h_copy, size)
    tensors = transformer_like(size, "cuda")
    layout = layout_of(tensors)
    stage = torch.zeros(layout.nbytes, dtype=torch.uint8).pin_memory()
    note = f"{len(tensors)} fp32 tensors, {CHUNK >> 20} MiB chunks"
    cases = [
        ("gather into pinned [triton]", lambda p, d: gather(p, d, backend="triton")),
        (
            "gather, zero-fill, into pinned [triton]",
            lambda p, d: gather(p, d, backend="triton", zero_fill=True),
        ),
        (
            "gather + pcf64 fused into pinned [triton]",
            lambda p, d: gather_checksum(p, d, backend="triton"),
        ),
        (
            "gather into pinned [torch: one memcpy per piece]",
            lambda p, d: gather(p, d, backend="torch"),
        ),
    ]
    for name, fn in cases:
        run = lambda f=fn: [c.result() for c in per_chunk(layout, stage, f)]  # noqa: E731
        d2h.run(name, run, layout.nbytes, note=note)

    d2d_out = torch.empty_like(dev)
    hbm = Bench(lambda: d2d_out.copy_(dev), size, "D2D copy", repeats, sync)
    hbm.run("device-to-device copy (HBM)", lambda: d2d_out.copy_(dev), size)
    x32 = torch.randn(size // 4, device="cuda") * 0.01
    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype)
        out = (
            torch.empty(x.numel(), dtype=torch.uint8, device="cuda"),
            torch.empty(-(-x.numel() // 256), device="cuda"),
        )
        for fmt in ("int8", "fp8_e4m3"):
            fn = lambda x=x, f=fmt, o=out: quantize_blockwise(x, f, 256, backend="triton", out=o)  # noqa: E731
            name = f"quantize {fmt}, {str(dtype).removeprefix('torch.')} in [triton]"
            hbm.run(name, fn, x.numel() * x.element_size(), note="bytes = input")
    hbm.run("checksum pcf64 [triton]", lambda: checksum(dev, backend="triton"), size)
    return d2h.rows + hbm.rows


def render(rows: list[Row], title: str, command: str, env: str) -> str:
    cells = []
    for r in rows:
        target = f"≥ {r.target:.1f}×" if r.target else ""
        met = ("yes" if r.ratio >= r.target else "**no**") if r.target else ""
        cells.append(
            [
                r.name,
                f"{r.nbytes / 2**20:.0f}",
                f"{r.gbps:.2f}",
                f"{r.ratio:.2f}",
                f"{r.baseline} {r.baseline_gbps:.2f}",
                target,
                met,
                r.note,
            ]
        )
    columns = ["kernel", "MiB", "GB/s", "× baseline", "baseline GB/s", "target", "met", "note"]
    lines = [*header(title, command), env, "", *table_lines(columns, cells, align="lrrrlrll")]
    return "\n".join(lines) + "\n"


def environment(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    parts = [
        f"CPU: {cpu}, {os.cpu_count()} logical cores (load average {load:.1f} at the end)",
        f"torch {torch.__version__}, numba {numba.__version__}, numpy {np.__version__}",
    ]
    if device == "cuda":
        import triton

        parts.append(f"GPU: {torch.cuda.get_device_name()}, triton {triton.__version__}")
    parts.append(
        "GB/s: best of the repeats. × baseline: median over the repeats of kernel GB/s / "
        "baseline GB/s, each kernel run paired with the baseline run just before it."
    )
    return "  \n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=128, help="bytes moved per measurement")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    size = args.size_mib << 20
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device in ("cpu", "all"):
        text = render(
            cpu_rows(size, args.repeats), "pcframe kernels on CPU", command, environment("cpu")
        )
        write_results(args.out / "kernels_cpu.md", text)
        print(text)
    if args.device in ("cuda", "all"):
        if not torch.cuda.is_available():
            print("no CUDA device: skipped the GPU benchmarks", file=sys.stderr)
            return
        text = render(
            gpu_rows(size, args.repeats), "pcframe kernels on GPU", command, environment("cuda")
        )
        write_results(args.out / "kernels_gpu.md", text)
        print(text)


if __name__ == "__main__":
    main()
