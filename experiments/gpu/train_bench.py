"""Part (c): checkpointing a real GPT-style training loop, one method per process.

Methods: ``none`` (no checkpoint: the step-time baseline), ``pcframe_torch`` (the engine's
default copy stage, ``Tensor.copy_`` on its side stream, crc32c), ``pcframe_triton``
(``copy_backend="triton"`` with ``checksum="pcf64"``: the fused Triton gather + checksum
straight into pinned staging) and ``dcp`` (``torch.distributed.checkpoint.async_save`` with
``DefaultStager(StagingOptions(use_pinned_memory=True, use_async_staging=True,
use_non_blocking_copy=True))``, a pre-step hook waiting for its staging so the optimizer
never changes weights still being copied, and one save in flight as DCP requires).

The model keeps fp32 master weights and computes in bf16 under autocast, with fused fp32
AdamW: 12 bytes of checkpoint per parameter (the GPU preset: ~1.08 B parameters, ~13 GB).
Each iteration is forward, backward, ``optimizer.step()``, then a sync on the training
stream (as a loop that logs its loss does), then the save call when one is due. Per
iteration we keep the wall time, the forward/backward time on the GPU (CUDA events) and
the save call's time; per checkpoint the engine's own records (stall, copy, time to
durable), a thread's timestamp of the copy's end, and from these:

* stall per checkpoint: the save iteration and the next two, less 3x this run's median
  iteration before any save;
* step-time overhead: the measured saves' whole intervals against the no-checkpoint run;
* overlap: the copy's window against the GPU's forward/backward windows, and for one extra
  checkpoint a torch.profiler trace (kept as ``trace_<method>.json.gz``).
"""

from __future__ import annotations

import contextlib
import gzip
import inspect
import math
import os
import shutil
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    Budget,
    error_text,
    log,
    proc_status,
    reset_peak_rss,
    stats,
    write_json,
)
from overlap import profiler_overlap, window_overlap
from torch import nn

METHODS = ("none", "pcframe_torch", "pcframe_triton", "dcp")
STALL_WINDOW = 3  # iterations charged to one checkpoint: the save's and the next two


@dataclass(frozen=True)
class ModelCfg:
    vocab: int
    seq: int
    d: int
    layers: int
    heads: int
    batch: int

    @property
    def params(self) -> int:
        per_layer = 12 * self.d * self.d + 13 * self.d  # qkv, proj, fc, out + biases, norms
        return self.layers * per_layer + (self.vocab + self.seq + 2) * self.d

    @property
    def checkpoint_bytes(self) -> int:
        return 12 * self.params  # fp32 weights + fp32 exp_avg + fp32 exp_avg_sq


PRESETS = {
    "gpu": ModelCfg(vocab=32768, seq=1024, d=2048, layers=20, heads=16, batch=8),
    "small": ModelCfg(vocab=8192, seq=512, d=1024, layers=8, heads=8, batch=8),
    "dry": ModelCfg(vocab=256, seq=32, d=64, layers=2, heads=4, batch=2),
}


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: ModelCfg) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Embedding(cfg.seq, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg.d, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok.weight)  # head tied to the embedding
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --- the checkpoint methods --------------------------------------------------------------


class NoCheckpoint:
    name = "none"

    def save(self, step: int) -> dict[str, Any]:
        raise RuntimeError("the no-checkpoint run never saves")

    def finish(self, timeout: float) -> list[dict[str, Any]]:
        return []

    def close(self, timeout: float) -> None:
        pass

    def info(self) -> dict[str, Any]:
        return {}


class PCFrameMethod:
    """pcframe's Checkpointer, measured through its records and a copy-done watcher."""

    def __init__(
        self, name: str, model, optimizer, root: Path, backend: str, checksum: str, writers: int
    ) -> None:
        from pcframe import Checkpointer

        self.name = name
        self.config = {
            "copy_backend": backend,
            "checksum": checksum,
            "keep_last": 1,
            "max_in_flight": 2,
            "writer_threads": writers,
        }
        self.ckpt = Checkpointer(root, model=model, optimizer=optimizer, **self.config)
        self.saves: dict[int, dict[str, Any]] = {}

    def save(self, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        handle = self.ckpt.save(step)
        returned = time.perf_counter()
        entry = {"version": handle.version, "step": step, "called": start, "returned": returned}
        self.saves[handle.version] = entry
        progress = getattr(handle, "_progress", None)
        if progress is not None:

            def watch() -> None:
                progress.copy_done.wait()
                entry["copy_done"] = time.perf_counter()
                progress.finished.wait()
                entry["finished"] = time.perf_counter()

            threading.Thread(target=watch, daemon=True).start()
        return entry

    def done(self, entry: dict[str, Any]) -> bool:
        return "finished" in entry

    def finish(self, timeout: float) -> list[dict[str, Any]]:
        with contextlib.suppress(Exception):
            self.ckpt.wait(timeout=timeout)
        out = []
        for version, rec in sorted(self.ckpt.records.items()):
            entry = self.saves.get(version, {})
            out.append(
                {
                    **entry,
                    "status": str(rec.status),
                    "nbytes": rec.nbytes,
                    "engine_stall_s": rec.stall,
                    "copy_s": rec.copy,
                    "durable_s": rec.durable or None,
                    "cpu_s": rec.cpu,
                    "error": rec.error,
                }
            )
        return out

    def close(self, timeout: float) -> None:
        self.ckpt.close(timeout=timeout)

    def info(self) -> dict[str, Any]:
        pool = getattr(getattr(self.ckpt, "pipeline", None), "pool", None)
        return {
            "config": self.config,
            "staging_pool_bytes": getattr(pool, "capacity_bytes", None),
            "staging_pinned": getattr(pool, "_pinned", None),
        }


class DCPMethod:
    """torch.distributed.checkpoint.async_save with a pinned-memory DefaultStager."""

    name = "dcp"

    def __init__(self, model, optimizer, root: Path, cuda: bool, writers: int) -> None:
        import torch.distributed.checkpoint as dcp

        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError as exc:
            raise RuntimeError(
                f"torch {torch.__version__} has no DefaultStager/StagingOptions "
                f"({exc}); the DCP comparison needs torch >= 2.9"
            ) from None
        self.dcp, self.model, self.optimizer, self.root = dcp, model, optimizer, root
        self.options = {
            "use_pinned_memory": cuda,
            "use_shared_memory": False,
            "use_async_staging": True,
            "use_non_blocking_copy": cuda,
        }
        try:
            options = StagingOptions(**self.options)
        except TypeError:  # another release's field names: the documented positional order
            options = StagingOptions(*self.options.values())
        self.stager = DefaultStager(options)
        # torch 2.11 closes DefaultStager's inner StateDictStager at the end of every stage,
        # so its second async_save fails (KeyError: <class 'type'>; pytorch/pytorch#183413,
        # fixed in 2.12 by keeping user-provided stagers open). Keep it open as the fixed
        # releases do, so DCP is measured with its buffers reused across saves; close() below
        # closes it for real.
        inner = getattr(self.stager, "_state_dict_stager", None)
        self._inner_close = getattr(inner, "close", None)
        if inner is not None and self._inner_close is not None:
            inner.close = lambda: None
        params = inspect.signature(dcp.async_save).parameters
        if "async_stager" not in params:
            raise RuntimeError(
                f"torch {torch.__version__}: dcp.async_save takes no async_stager; the "
                "DefaultStager comparison needs a newer torch"
            )
        self.kwargs: dict[str, Any] = {"async_stager": self.stager}
        if "no_dist" in params:
            self.kwargs["no_dist"] = True
        self.writers = writers
        self.staging: Any = None
        self.upload: Any = None
        self.current: dict[str, Any] | None = None
        self.saves: list[dict[str, Any]] = []
        self.n = 0
        self.hook = optimizer.register_step_pre_hook(self._gate)

    def _gate(self, *_: Any) -> None:
        staging, entry = self.staging, self.current
        if staging is None or entry is None:
            return
        if not staging.done():
            start = time.perf_counter()
            staging.result()
            entry["gate_wait_s"] = entry.get("gate_wait_s", 0.0) + time.perf_counter() - start
        entry.setdefault("copy_done", time.perf_counter())
        self.staging = None

    def _writer(self, path: Path) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        try:
            return FileSystemWriter(str(path), thread_count=self.writers)
        except TypeError:
            return FileSystemWriter(str(path))

    def save(self, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        waited = 0.0
        if self.upload is not None:  # one save in flight: its staged buffers are reused
            w0 = time.perf_counter()
            self.upload.result()
            waited = time.perf_counter() - w0
        self.n += 1
        path = self.root / f"ckpt{self.n:04d}"
        entry: dict[str, Any] = {
            "version": self.n,
            "step": step,
            "called": start,
            "wait_previous_s": waited,
        }
        # DCP's own way (fully qualified names), as its tutorial and the CPU bench do, in
        # plain dicts: on torch 2.11 DefaultStager's deep copy cannot rebuild an
        # OrderedDict (KeyError: <class 'type'>, the H200 run of 2026-12-04).
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = _plain({"model": model_state, "optim": optim_state})
        entry["nbytes"] = sum(
            t.numel() * t.element_size() for t in _tensors(state) if isinstance(t, torch.Tensor)
        )
        response = self.dcp.async_save(
            state, checkpoint_id=str(path), storage_writer=self._writer(path), **self.kwargs
        )
        entry["returned"] = time.perf_counter()
        staging = getattr(response, "staging_completion", None)
        upload = getattr(response, "upload_completion", response)
        entry["async_staging"] = staging is not None
        if staging is None:
            entry["copy_done"] = entry["returned"]

        previous = self.root / f"ckpt{self.n - 1:04d}"

        def finished(_: Any) -> None:
            entry["finished"] = time.perf_counter()
            # keep the newest one only (pcframe runs with keep_last=1); off the training thread
            if previous.exists():
                threading.Thread(target=shutil.rmtree, args=(previous, True), daemon=True).start()

        upload.add_done_callback(finished)
        self.staging, self.upload, self.current = staging, upload, entry
        self.saves.append(entry)
        return entry

    def done(self, entry: dict[str, Any]) -> bool:
        return "finished" in entry

    def finish(self, timeout: float) -> list[dict[str, Any]]:
        if self.upload is not None:
            with contextlib.suppress(Exception):
                self.upload.result(timeout=timeout)
        for e in self.saves:
            e["engine_stall_s"] = (e["returned"] - e["called"]) + e.get("gate_wait_s", 0.0)
            e["copy_s"] = e["copy_done"] - e["called"] if "copy_done" in e else None
            e["durable_s"] = e["finished"] - e["called"] if "finished" in e else None
            e["status"] = "committed" if "finished" in e else "unfinished"
        return self.saves

    def close(self, timeout: float) -> None:
        self.hook.remove()
        self.stager.close()
        if self._inner_close is not None:
            self._inner_close()  # the real one (see __init__)

    def info(self) -> dict[str, Any]:
        return {
            "staging_options": self.options,
            "writer_threads": self.writers,
            "async_save_kwargs": sorted(k for k in self.kwargs if k != "async_stager"),
            "stager_kept_open": "inner StateDictStager.close deferred to the end "
            "(pytorch/pytorch#183413 on torch 2.11)",
        }


def _plain(tree: Any) -> Any:
    """The same tree with every mapping a plain dict (tensors and leaves shared)."""
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_plain(v) for v in tree]
    return tree


def _tensors(tree: Any):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


# --- the loop ----------------------------------------------------------------------------


class Run:
    def __init__(self, args: Any, out: Path, budget: Budget) -> None:
        self.args, self.out, self.budget = args, out, budget
        self.cuda = torch.cuda.is_available() and not args.dry_run
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.cfg = PRESETS[args.model]
        self.t_origin = time.perf_counter()
        self.steps: list[dict[str, Any]] = []
        self.result: dict[str, Any] = {
            "method": args.method,
            "dry_run": args.dry_run,
            "device": torch.cuda.get_device_name() if self.cuda else "cpu",
            "model": {**asdict(self.cfg), "params": None, "preset": args.model},
            "every": args.every,
            "notes": [],
        }
        self.method: Any = None

    def note(self, text: str) -> None:
        log(f"{self.args.method}:", text)
        self.result["notes"].append(text)

    def save_json(self) -> None:
        self.result["steps"] = self.steps
        self.result["seconds"] = self.budget.used()
        write_json(self.out, self.result)

    def build(self) -> None:
        torch.manual_seed(0)
        with torch.device(self.device):
            self.model = GPT(self.cfg)
        fused = {"fused": True} if self.cuda else {"foreach": True}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, **fused)
        self.gen = torch.Generator(device=self.device).manual_seed(1)
        n = sum(p.numel() for p in self.model.parameters())
        self.result["model"]["params"] = n
        self.result["model"]["checkpoint_bytes_estimate"] = 12 * n

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        data = torch.randint(
            0, c.vocab, (c.batch, c.seq + 1), device=self.device, generator=self.gen
        )
        return data[:, :-1], data[:, 1:]

    def step(self, save: bool = False) -> dict[str, Any]:
        x, y = self.batch()
        t0 = time.perf_counter()
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.model(x, y)
        loss.backward()
        if self.cuda:
            e1.record()
        t1 = time.perf_counter()
        self.optimizer.step()
        t2 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.cuda:
            end = torch.cuda.Event()
            end.record()
            end.synchronize()  # the training stream only: a side stream may go on copying
            fwdbwd = e0.elapsed_time(e1) / 1e3
        else:
            fwdbwd = t1 - t0
        t3 = time.perf_counter()
        rec: dict[str, Any] = {
            "i": len(self.steps),
            "t0": t0 - self.t_origin,
            "fwdbwd_gpu_s": fwdbwd,
            "opt_call_s": t2 - t1,
            "save_call_s": 0.0,
        }
        if save:
            entry = self.method.save(len(self.steps))
            rec["save_version"] = entry["version"]
            rec["save_call_s"] = time.perf_counter() - t3
        rec["iter_s"] = time.perf_counter() - t0
        rec["loss"] = float(loss.detach()) if rec["i"] % 10 == 0 else None
        self.steps.append(rec)
        return rec

    def make_method(self) -> Any:
        a = self.args
        root = Path(a.ckpt_root) / a.method
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        if a.method == "none":
            return NoCheckpoint()
        if a.method == "pcframe_torch":
            return PCFrameMethod(
                a.method, self.model, self.optimizer, root, "torch", "crc32c", a.writers
            )
        if a.method == "pcframe_triton":
            return PCFrameMethod(
                a.method, self.model, self.optimizer, root, "triton", "pcf64", a.writers
            )
        if a.method == "dcp":
            return DCPMethod(self.model, self.optimizer, root, self.cuda, a.writers)
        raise ValueError(f"unknown method {a.method!r}; choose one of {METHODS}")

    def main(self) -> None:
        a = self.args
        self.build()
        log(
            f"{a.method}: {self.result['model']['params'] / 1e6:.1f} M parameters on "
            f"{self.device}, ~{12 * self.result['model']['params'] / 1e9:.1f} GB of checkpoint"
        )
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            self.result["gpu_memory_after_build"] = {"free": free, "total": total}
        for _ in range(a.warmup):
            self.step()
        self.steps.clear()
        self.method = self.make_method()
        self.result["method_info"] = self.method.info()
        self.result["rss_before_bytes"] = proc_status("VmRSS")
        self.result["rss_peak_reset"] = reset_peak_rss()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(a.clean_steps):
            self.step()
        clean = statistics.median(s["iter_s"] for s in self.steps)
        self.result["clean_iter_s"] = clean
        self.result["clean_fwdbwd_gpu_s"] = statistics.median(s["fwdbwd_gpu_s"] for s in self.steps)
        self.save_json()
        if a.method == "none":
            while self.budget.left() > 2.0 and len(self.steps) < a.clean_steps + a.none_steps:
                self.step()
            self.finish_run([])
            return
        every = a.every or max(3, math.ceil(a.interval_s / clean))
        self.result["every"] = every
        # warm-up checkpoint: staging allocation, layouts, kernel compilation
        first = self.step(save=True)
        while not self._durable(first) and self.budget.left() > 10.0:
            self.step()
        self.result["first_save_index"] = first["i"]
        self.save_json()
        saves: list[int] = []
        for k in range(a.saves):
            need = every * clean * 1.5 + 5.0 + (12.0 if a.profile else 0.0)
            if not self.budget.enough(need):
                self.note(f"budget: stopped after {k} measured checkpoints")
                break
            saves.append(self.step(save=True)["i"])
            for _ in range(every - 1):
                self.step()
            self.save_json()
        self.result["measured_save_indices"] = saves
        end_measured = len(self.steps)
        if a.profile and self.budget.enough(10.0):
            self.profile(every)
        self.finish_run(saves, end_measured)

    def _durable(self, rec: dict[str, Any]) -> bool:
        entry = next(
            (e for e in self._entries() if e.get("version") == rec.get("save_version")), None
        )
        return entry is not None and self.method.done(entry)

    def _entries(self) -> list[dict[str, Any]]:
        m = self.method
        return list(m.saves.values()) if isinstance(m.saves, dict) else list(m.saves)

    def profile(self, every: int) -> None:
        """One more checkpoint under torch.profiler: the copy against forward/backward."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
        trace = self.out.parent / f"trace_{self.args.method}.json"
        try:
            with profile(activities=acts) as prof:
                self.step(save=True)
                for _ in range(min(3, every)):
                    self.step()
                if self.cuda:
                    torch.cuda.synchronize()
            prof.export_chrome_trace(str(trace))
            self.result["profile"] = profiler_overlap(trace)
            self.result["profile"]["save_index"] = len(self.steps) - min(3, every) - 1
            with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb", 6) as dst:
                shutil.copyfileobj(src, dst)
            os.remove(trace)
            self.result["profile"]["trace_file"] = trace.name + ".gz"
        except Exception as exc:
            self.result["profile"] = {"available": False, "error": error_text(exc)}
            self.note(f"profiler failed: {error_text(exc)}")

    def finish_run(self, saves: list[int], end_measured: int | None = None) -> None:
        a = self.args
        records = self.method.finish(timeout=max(5.0, self.budget.left() - 5.0))
        self.result["rss_peak_bytes"] = proc_status("VmHWM")
        self.result["rss_end_bytes"] = proc_status("VmRSS")
        if self.cuda:
            self.result["gpu_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
            with contextlib.suppress(Exception):
                hs = torch.cuda.host_memory_stats()
                self.result["host_pinned_allocator"] = {
                    k: v
                    for k, v in hs.items()
                    if ("bytes" in k and ("peak" in k or "current" in k)) or "host_alloc" in k
                }
        self.result["saves"] = records
        self.result["method_info"] = self.method.info()  # the staging pool exists by now
        self.summarise(records, saves, end_measured)
        self.save_json()
        try:
            self.method.close(timeout=max(5.0, self.budget.left() - 3.0))
        except Exception as exc:
            self.note(f"close failed: {error_text(exc)}")
            self.save_json()
            os._exit(3)
        shutil.rmtree(getattr(self, "root", Path(a.ckpt_root) / a.method), ignore_errors=True)

    def summarise(self, records: list[dict], saves: list[int], end: int | None) -> None:
        steps = self.steps
        clean = self.result["clean_iter_s"]
        iters = [s["iter_s"] for s in steps]
        summary: dict[str, Any] = {"iter_s": stats(iters[: self.args.clean_steps])}
        if self.args.method == "none" or not saves:
            summary["iter_s"] = stats(iters)
            self.result["summary"] = summary
            return
        by_version = {r.get("version"): r for r in records}
        index_version = {s["i"]: s.get("save_version") for s in steps if "save_version" in s}
        per_save = []
        for i in saves:
            window = steps[i : i + STALL_WINDOW]
            rec = by_version.get(index_version.get(i), {})
            loop_stall = sum(s["iter_s"] for s in window) - clean * len(window)
            item = {
                "index": i,
                "loop_stall_s": loop_stall,
                "engine_stall_s": rec.get("engine_stall_s"),
                "save_call_s": steps[i]["save_call_s"],
                "copy_s": rec.get("copy_s"),
                "durable_s": rec.get("durable_s"),
                "status": rec.get("status"),
            }
            if "copy_done" in rec and "returned" in rec:
                # GPU forward/backward windows in host time: each starts at the step's t0
                # (the training stream is idle then) and lasts its event-timed duration.
                windows = [
                    (s["t0"], s["t0"] + s["fwdbwd_gpu_s"])
                    for s in steps[i + 1 : i + 1 + STALL_WINDOW]
                ]
                copy_win = (rec["returned"] - self.t_origin, rec["copy_done"] - self.t_origin)
                item["window_overlap"] = window_overlap(copy_win, windows)
            per_save.append(item)
        stop = end if end is not None else len(steps)
        span = steps[saves[0] : stop]
        summary.update(
            {
                "per_save": per_save,
                "loop_stall_s": stats([p["loop_stall_s"] for p in per_save]),
                "engine_stall_s": stats([p["engine_stall_s"] for p in per_save]),
                "copy_s": stats([p["copy_s"] for p in per_save]),
                "durable_s": stats([p["durable_s"] for p in per_save]),
                "window_overlap_fraction": stats(
                    [
                        p["window_overlap"]["overlap_fraction_of_copy"]
                        for p in per_save
                        if p.get("window_overlap")
                    ]
                ),
                "measured_iterations": len(span),
                "measured_mean_iter_s": statistics.fmean(s["iter_s"] for s in span),
                "overhead_vs_own_clean": statistics.fmean(s["iter_s"] for s in span) / clean - 1,
                "checkpoint_bytes": next(
                    (r.get("nbytes") for r in records if r.get("nbytes")), None
                ),
            }
        )
        if self.args.baseline_iter_s:
            summary["overhead_vs_none"] = (
                statistics.fmean(s["iter_s"] for s in span) / self.args.baseline_iter_s - 1
            )
        first = self.result.get("first_save_index")
        if first is not None:
            rec = by_version.get(index_version.get(first), {})
            window = steps[first : first + STALL_WINDOW]
            summary["first_save"] = {
                "loop_stall_s": sum(s["iter_s"] for s in window) - clean * len(window),
                "engine_stall_s": rec.get("engine_stall_s"),
                "durable_s": rec.get("durable_s"),
            }
        self.result["summary"] = summary


def run(args: Any, out: Path) -> None:
    budget = Budget(args.budget)
    r = Run(args, out, budget)
    try:
        r.main()
    except Exception as exc:
        r.result["error"] = error_text(exc)
        log(f"{args.method}: FAILED: {r.result['error']}")
        import traceback

        r.result["traceback"] = traceback.format_exc()[-4000:]
        r.save_json()
        os._exit(2)  # no atexit wait for versions still in flight
    log(f"{args.method}: done in {budget.used():.1f} s")
