"""Part (b): bandwidth of pcframe's Triton kernels, each beside its limit measured in this run.

Copy kernels (HBM -> pinned host memory) are compared with ``copy_(non_blocking=True)`` of
the same bytes into pinned memory (the PCIe D2H limit); quantization, XOR delta and the
checksum with a device-to-device ``copy_`` (the HBM limit, bytes read + bytes written).
Every row is timed with CUDA events around the public API call (what the engine pays,
host planning and syncs included): the median of ``repeats`` runs after warm-up, with
min / max. Where the profiler works, the same calls are profiled once more and the
kernels' own device time gives a second, "kernel only" figure.

On a machine without CUDA (``--dry-run``) the same code runs on CPU tensors at toy sizes,
Triton through its interpreter (TRITON_INTERPRET=1 must be set before triton is imported)
and host copies stand in for the limits: the numbers mean nothing, the code paths run.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import Budget, error_text, log, stats, write_json

CHUNK_GPU = 16 << 20  # the engine's default chunk_bytes
GOAL_COPY = 0.8  # x the D2H limit
GOAL_HBM = 0.7  # x the device-to-device copy


class Timer:
    """Times a callable with CUDA events on ``stream`` (or the wall clock on CPU)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn: Callable[[], Any], stream: Any = None) -> float:
        self.sync()
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        s = stream or torch.cuda.current_stream()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(s)
        fn()
        end.record(s)
        end.synchronize()
        self.sync()  # work another stream still does belongs to this run too
        return begin.elapsed_time(end) / 1e3

    def repeat(
        self, fn: Callable[[], Any], repeats: int, warmup: int, stream: Any = None
    ) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        return [self.once(fn, stream) for _ in range(repeats)]


def kernel_only(fn: Callable[[], Any], repeats: int, patterns: tuple[str, ...]) -> dict | None:
    """Device time of the kernels / memcpys whose names contain ``patterns``, per call.

    Measured with torch.profiler (CUPTI); None when the profiler gives no such events.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    hits = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        and any(p in e.get("name", "") for p in patterns)
    ]
    if not hits:
        return None
    total = sum(float(e.get("dur", 0.0)) for e in hits) / 1e6
    return {
        "seconds_per_call": total / repeats,
        "launches_per_call": len(hits) / repeats,
        "names": sorted({e["name"][:80] for e in hits})[:4],
    }


def transformer_like(total: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    """fp32 tensors shaped like a transformer's parameters (plus a few odd sizes)."""
    g = torch.Generator(device=device).manual_seed(seed)
    d = 1024 if total >= 256 << 20 else 64
    shapes = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,), (d,), (1001,), (7,)]
    out: list[torch.Tensor] = []
    used = 0
    while used < total:
        for shape in shapes:
            t = torch.randn(shape, generator=g, device=device)
            out.append(t)
            used += t.numel() * 4
            if used >= total:
                break
    return out


def layout_pieces(tensors: list[torch.Tensor], chunk: int) -> tuple[Any, list[list[tuple]]]:
    """The engine's own Layout over ``tensors`` and each chunk's pieces (kernels' input)."""
    from pcframe.format.layout import Layout

    flats = [t.reshape(-1).view(torch.uint8) for t in tensors]
    named = [(f"t{i}", t) for i, t in enumerate(tensors)]
    layout = Layout.build(named, chunk, 64)
    per_chunk = [
        [(flats[p.entry], p.src_start, p.dst_start, p.nbytes) for p in c.pieces]
        for c in layout.chunks
    ]
    return layout, per_chunk


class KernelBench:
    def __init__(self, out: Path, budget: Budget, dry_run: bool, size: int, repeats: int):
        self.out, self.budget, self.dry_run = out, budget, dry_run
        self.cuda = torch.cuda.is_available() and not dry_run
        self.device = "cuda" if self.cuda else "cpu"
        self.size, self.repeats = size, repeats
        self.timer = Timer(self.cuda)
        self.result: dict[str, Any] = {
            "dry_run": dry_run,
            "device": torch.cuda.get_device_name() if self.cuda else "cpu",
            "bytes": size,
            "repeats": repeats,
            "chunk_bytes": None,
            "limits": {},
            "rows": [],
            "notes": [],
            "checks": {},
        }
        self.triton_ok = self._triton_usable()

    def _triton_usable(self) -> bool:
        try:
            import triton  # noqa: F401
        except Exception as exc:
            self.note(f"triton not importable ({error_text(exc)}): Triton rows skipped")
            return False
        if not self.cuda:
            from pcframe.kernels.dispatch import triton_interpreting

            if not triton_interpreting():
                self.note("no CUDA and TRITON_INTERPRET is not set: Triton rows skipped")
                return False
            self.note("Triton runs in its CPU interpreter (dry run): numbers are meaningless")
        return True

    def note(self, text: str) -> None:
        log("kernels:", text)
        self.result["notes"].append(text)

    def save(self) -> None:
        write_json(self.out, self.result)

    # --- measurements -------------------------------------------------------------------

    def limit(self, key: str, name: str, fn: Callable[[], Any], moved: int, stream=None) -> None:
        times = self.timer.repeat(fn, self.repeats, 2, stream)
        st = stats(times)
        self.result["limits"][key] = {
            "name": name,
            "bytes_moved": moved,
            "seconds": st,
            "gbps": moved / st["median"] / 1e9,
            "gbps_min": moved / st["max"] / 1e9,
            "gbps_max": moved / st["min"] / 1e9,
        }
        log(f"kernels: limit {name}: {moved / st['median'] / 1e9:.1f} GB/s")
        self.save()

    def row(
        self,
        name: str,
        fn: Callable[[], Any],
        moved: int,
        limit: str,
        goal: float,
        patterns: tuple[str, ...] = (),
        stream: Any = None,
        note: str = "",
    ) -> None:
        if not self.budget.enough(3.0):
            self.note(f"budget spent: {name} not measured")
            return
        entry: dict[str, Any] = {"name": name, "bytes_moved": moved, "limit": limit, "goal": goal}
        entry["note"] = note
        try:
            times = self.timer.repeat(fn, self.repeats, 2, stream)
            st = stats(times)
            entry["seconds"] = st
            entry["gbps"] = moved / st["median"] / 1e9
            entry["gbps_min"] = moved / st["max"] / 1e9
            entry["gbps_max"] = moved / st["min"] / 1e9
            lim = self.result["limits"].get(limit)
            if lim:
                entry["ratio"] = entry["gbps"] / lim["gbps"]
                entry["met"] = entry["ratio"] >= goal
            if self.cuda and patterns and self.budget.enough(5.0):
                try:
                    k = kernel_only(fn, max(3, self.repeats // 2), patterns)
                except Exception as exc:
                    k = {"error": error_text(exc)}
                if k and "seconds_per_call" in k:
                    k["gbps"] = moved / k["seconds_per_call"] / 1e9
                    if lim:
                        k["ratio"] = k["gbps"] / lim["gbps"]
                        k["met"] = k["ratio"] >= goal
                entry["kernel_only"] = k
            log(f"kernels: {name}: {entry['gbps']:.1f} GB/s ratio {entry.get('ratio', 0):.2f}")
        except Exception as exc:
            entry["error"] = error_text(exc)
            log(f"kernels: {name} FAILED: {entry['error']}")
        self.result["rows"].append(entry)
        self.save()

    def run(self) -> dict:
        self.save()
        try:
            self._copy_rows()
        except Exception as exc:
            self.note(f"copy rows aborted: {error_text(exc)}")
        try:
            self._hbm_rows()
        except Exception as exc:
            self.note(f"HBM rows aborted: {error_text(exc)}")
        self.result["seconds"] = self.budget.used()
        self.save()
        return self.result

    def _copy_rows(self) -> None:
        from pcframe.kernels import gather, gather_checksum
        from pcframe.kernels._completion import side_stream

        n, dev = self.size, self.device
        chunk = CHUNK_GPU if self.cuda else 256 << 10
        self.result["chunk_bytes"] = chunk
        pin = self.cuda
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
        stream = side_stream(torch.device(dev)) if self.cuda else None

        def d2h() -> None:
            host.copy_(src, non_blocking=True)

        name = (
            "copy_ D2H into pinned (non_blocking)" if self.cuda else "copy_ host->host (stand-in)"
        )
        self.limit("d2h", name, d2h, n)

        def d2h_chunks() -> None:
            for off in range(0, n, chunk):
                host[off : off + chunk].copy_(src[off : off + chunk], non_blocking=True)

        self.row(
            f"copy_ D2H per {chunk >> 20 or chunk >> 10} {'MiB' if chunk >> 20 else 'KiB'}",
            d2h_chunks,
            n,
            "d2h",
            GOAL_COPY,
            ("Memcpy",),
        )

        tensors = transformer_like(n, dev)
        layout, per_chunk = layout_pieces(tensors, chunk)
        size = layout.data_size
        staging = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        views = [staging[c.offset : c.offset + c.length] for c in layout.chunks]
        all_pieces = [
            (t.reshape(-1).view(torch.uint8), 0, e.offset, e.nbytes)
            for t, e in zip(tensors, layout.entries, strict=True)
        ]
        self.result["layout"] = {
            "tensors": len(tensors),
            "bytes": size,
            "chunks": len(per_chunk),
            "pieces": sum(len(p) for p in per_chunk),
        }

        def per_chunk_gather(backend: str, fused: bool, wait_each: bool = True):
            """Chunk after chunk into pinned staging; like the engine's copy thread, each
            chunk is waited for before the next is planned (``wait_each=False``: all
            launched back to back, waited at the end)."""

            def fn() -> None:
                pending = []
                for pieces, view in zip(per_chunk, views, strict=True):
                    if fused:
                        d = gather_checksum(pieces, view, backend=backend, stream=stream)
                    else:
                        d = gather(pieces, view, backend=backend, zero_fill=True, stream=stream)
                    if wait_each:
                        d.result()
                    else:
                        pending.append(d)
                for d in pending:
                    d.result()

            return fn

        if self.triton_ok:
            self._check_gather(per_chunk, views, stream)
            self.row(
                "gather [triton] per chunk, zero_fill (engine, no fused checksum)",
                per_chunk_gather("triton", False),
                size,
                "d2h",
                GOAL_COPY,
                ("gather_blocks", "copy_tiles"),
                stream,
            )
            self.row(
                "gather_checksum [triton] per chunk (engine with pcf64)",
                per_chunk_gather("triton", True),
                size,
                "d2h",
                GOAL_COPY,
                ("gather_blocks",),
                stream,
            )
            self.row(
                "gather_checksum [triton] per chunk, launched back to back",
                per_chunk_gather("triton", True, wait_each=False),
                size,
                "d2h",
                GOAL_COPY,
                ("gather_blocks",),
                stream,
                note="not the engine's pattern: no wait between chunks",
            )

            def one_call() -> int:
                return gather_checksum(
                    all_pieces, staging, backend="triton", stream=stream
                ).result()

            self.row(
                "gather_checksum [triton], one call for the whole layout",
                one_call,
                size,
                "d2h",
                GOAL_COPY,
                ("gather_blocks",),
                stream,
            )
        self.row(
            "gather [torch] per chunk (engine default copy_backend=torch)",
            per_chunk_gather("torch", False),
            size,
            "d2h",
            GOAL_COPY,
            ("Memcpy",),
            stream,
            note="reference path, for context",
        )
        if not self.cuda:
            # the Numba path is what the CPU engine uses; kept as a sanity row in the dry run
            self.row(
                "gather_checksum [numba] per chunk",
                per_chunk_gather("numba", True),
                size,
                "d2h",
                GOAL_COPY,
            )

    def _check_gather(self, per_chunk, views, stream) -> None:
        """Poisoned buffers, one gather: the bytes and pcf64 must match the torch reference."""
        from pcframe.kernels import checksum, gather, gather_checksum

        ok = True
        for i in sorted({0, len(per_chunk) - 1}):
            view = views[i]
            view.fill_(0xAB)
            value = gather_checksum(per_chunk[i], view, backend="triton", stream=stream).result()
            ref = torch.full_like(view, 0xCD)
            gather(per_chunk[i], ref, backend="torch", zero_fill=True).wait()
            same = bool(torch.equal(view, ref))
            ok = ok and same and value == checksum(ref.numpy(), backend="numba")
        self.result["checks"]["triton_gather_matches_torch_and_pcf64"] = ok
        if not ok:
            self.note("CHECK FAILED: Triton gather_checksum differs from the torch reference")

    def _hbm_rows(self) -> None:
        from pcframe.kernels import (
            checksum,
            dequantize_blockwise,
            encode_delta,
            quantize_blockwise,
        )

        n, dev = self.size, self.device
        a = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)

        def d2d() -> None:
            b.copy_(a)

        self.limit(
            "d2d",
            "copy_ device->device (read + write)" if self.cuda else "copy_ host->host (stand-in)",
            d2d,
            2 * n,
        )
        if not self.triton_ok:
            return
        backend = "triton"
        elems = n // 4
        g = torch.Generator(device=dev).manual_seed(1)
        x = torch.randn(elems, generator=g, device=dev) * 0.01
        nb = -(-elems // 256)
        codes = torch.empty(elems, dtype=torch.uint8, device=dev)
        scales = torch.empty(nb, dtype=torch.float32, device=dev)
        q_moved = 4 * elems + elems + 4 * nb
        for fmt in ("int8", "fp8_e4m3"):
            q = quantize_blockwise(x[:4096], fmt, 256, backend=backend)
            err = (dequantize_blockwise(q, backend=backend) - x[:4096]).abs()
            self.result["checks"][f"quantize_{fmt}_within_bound"] = bool(
                (err.reshape(-1, 256).amax(1) <= q.error_bound).all()
            )
            self.row(
                f"quantize {fmt}, fp32 in, block 256 [triton]",
                lambda f=fmt: quantize_blockwise(x, f, 256, backend=backend, out=(codes, scales)),
                q_moved,
                "d2d",
                GOAL_HBM,
                ("quantize",),
                note="bytes = fp32 in + codes + scales out; API includes the NaN check "
                "and error bounds (host syncs)",
            )
        qi = quantize_blockwise(x, "int8", 256, backend=backend)
        out = torch.empty_like(x)
        self.row(
            "dequantize int8 -> fp32 [triton]",
            lambda: dequantize_blockwise(qi, backend=backend, out=out),
            elems + 4 * elems + 4 * nb,
            "d2d",
            GOAL_HBM,
            ("dequantize",),
        )
        prev = x + 1e-4
        delta = torch.empty(n, dtype=torch.uint8, device=dev)
        self.result["checks"]["xor_delta_matches_torch"] = bool(
            torch.equal(
                encode_delta(x[:4096], prev[:4096], backend=backend),
                encode_delta(x[:4096].cpu(), prev[:4096].cpu(), backend="torch").to(dev),
            )
        )
        self.row(
            "XOR delta encode [triton]",
            lambda: encode_delta(x, prev, backend=backend, out=delta),
            3 * n,
            "d2d",
            GOAL_HBM,
            ("xor",),
            note="bytes = 2 inputs read + 1 written",
        )
        data = delta
        self.result["checks"]["pcf64_triton_matches_numba"] = checksum(
            data[: 1 << 20], backend=backend
        ) == checksum(data[: 1 << 20].cpu(), backend="numba")
        self.row(
            "checksum pcf64 [triton]",
            lambda: checksum(data, backend=backend),
            n,
            "d2d",
            GOAL_HBM,
            ("pcf64",),
            note="bytes = input read",
        )


def run(out: Path, budget_s: float, dry_run: bool, size_mib: int | None, repeats: int | None):
    budget = Budget(budget_s)
    cuda = torch.cuda.is_available() and not dry_run
    size = (size_mib or (1024 if cuda else 1)) << 20
    bench = KernelBench(out, budget, dry_run, size, repeats or (10 if cuda else 2))
    log(f"kernels: {size >> 20} MiB on {bench.device}, budget {budget_s:.0f} s")
    result = bench.run()
    log(f"kernels: done in {budget.used():.1f} s")
    return result
