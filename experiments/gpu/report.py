"""Merge the parts' JSON into results.json and render gpu_h200.md (Markdown tables)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from common import read_json, write_json

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import table_lines, write_results

GOAL_OVERHEAD = 0.03


def fmt(x: Any, digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
    if x is None:
        return "–"
    try:
        return f"{float(x) * scale:.{digits}f}{unit}"
    except (TypeError, ValueError):
        return str(x)


def spread(st: dict | None, digits: int = 1, scale: float = 1.0) -> str:
    if not st or st.get("median") is None:
        return "–"
    if st.get("n", 0) < 2:
        return fmt(st["median"], digits, scale)
    return (
        f"{fmt(st['median'], digits, scale)} "
        f"[{fmt(st['min'], digits, scale)}–{fmt(st['max'], digits, scale)}]"
    )


def yes(flag: Any) -> str:
    return "–" if flag is None else ("yes" if flag else "**no**")


def all_of(flags: list) -> bool | None:
    known = [f for f in flags if f is not None]
    return all(known) if known else None


def any_of(flags: list) -> bool | None:
    known = [f for f in flags if f is not None]
    return any(known) if known else None


def env_section(env: dict | None) -> list[str]:
    if not env:
        return ["## Machine", "", "(env part produced nothing)", ""]
    v = env.get("versions", {})
    gpu = env.get("gpu", {})
    lines = ["## Machine and versions", ""]
    smi = (env.get("nvidia_smi_query") or "").strip()
    lines += [
        f"* GPU: {gpu.get('name', 'none')} ({fmt(gpu.get('total_memory'), 0, 2**-30)} GiB, "
        f"{gpu.get('multiprocessors', '–')} SMs, capability {gpu.get('capability', '–')})",
        f"* torch {v.get('torch')} (CUDA {env.get('torch_cuda')}), triton {v.get('triton')}, "
        f"numba {v.get('numba')}, numpy {v.get('numpy')}, Python {env.get('python')}",
        f"* {env.get('cpus')} CPUs, {fmt(env.get('mem_total_bytes'), 0, 2**-30)} GiB RAM, "
        f"/dev/shm {fmt(env.get('shm_free_bytes'), 0, 1e-9)} GB free, "
        f"/tmp {fmt(env.get('tmp_free_bytes'), 0, 1e-9)} GB free; "
        f"kernel {env.get('uname', {}).get('release')}",
        f"* pcframe at {env.get('git', '?')[:40]}",
    ]
    if smi:
        lines += ["", "nvidia-smi:", "", "```", smi, "```"]
    return [*lines, ""]


def tests_section(tests: dict | None) -> list[str]:
    lines = ["## Tests (Triton compiled for the GPU, not the interpreter)", ""]
    if not tests:
        return [*lines, "(tests part produced nothing)", ""]
    names = {"gpu": "`pytest -m gpu tests`", "kernels": "`pytest tests/kernels -m 'not gpu'`"}
    rows = []
    for name, t in tests.items():
        if "error" in t:
            rows.append([names.get(name, name), t["error"], "", "", "", t.get("exit_code"), ""])
            continue
        timed_out = " (timed out)" if t.get("timed_out") else ""
        rows.append(
            [
                names.get(name, name),
                t["passed"],
                t["failed"],
                t["errors"],
                t["skipped"],
                f"{t.get('exit_code')}{timed_out}",
                fmt(t.get("time_s")),
            ]
        )
    columns = ["suite", "passed", "failed", "errors", "skipped", "exit", "time s"]
    lines += table_lines(columns, rows)
    for name, t in tests.items():
        if t.get("failures"):
            lines += ["", f"Failing in {name}:", ""] + [f"* `{f}`" for f in t["failures"]]
    return [*lines, ""]


def kernels_section(k: dict | None) -> tuple[list[str], dict]:
    lines = ["## Kernel bandwidths", ""]
    goals: dict = {}
    if not k:
        return [*lines, "(kernels part produced nothing)", ""], goals
    lay = k.get("layout", {})
    lines += [
        f"{fmt(k.get('bytes'), 0, 2**-20)} MiB per call, median of {k.get('repeats')} runs "
        f"[min–max], CUDA events around the public API call (host planning and syncs "
        f"included); 'kernel only' is the kernels' own device time from torch.profiler. "
        f"Copy layout: {lay.get('tensors')} tensors, {lay.get('chunks')} chunks of "
        f"{fmt(k.get('chunk_bytes'), 0, 2**-20)} MiB, {lay.get('pieces')} pieces.",
        "",
    ]
    limits = [
        [
            f"{key}: {lim['name']}",
            f"{fmt(lim['gbps'])} [{fmt(lim['gbps_min'])}–{fmt(lim['gbps_max'])}]",
        ]
        for key, lim in k.get("limits", {}).items()
    ]
    lines += table_lines(["limit (same run)", "GB/s median [min–max]"], limits)
    rows = []
    for r in k.get("rows", []):
        if "error" in r:
            rows.append([r["name"], f"FAILED: {r['error'][:120]}", "", "", "", "", ""])
            continue
        ko = r.get("kernel_only") or {}
        rows.append(
            [
                r["name"],
                f"{fmt(r.get('gbps'))} [{fmt(r.get('gbps_min'))}–{fmt(r.get('gbps_max'))}]",
                f"{fmt(r.get('ratio'), 2)} vs {r['limit']}",
                r["goal"],
                yes(r.get("met")),
                fmt(ko.get("gbps")),
                fmt(ko.get("ratio"), 2),
            ]
        )
        goals[r["name"]] = (r.get("met"), ko.get("met"), r.get("limit"))
    columns = ["kernel", "GB/s median [min–max]", "x limit", "goal", "met", "kernel only GB/s"]
    columns += ["kernel only x limit"]
    lines += ["", *table_lines(columns, rows)]
    checks = k.get("checks", {})
    if checks:
        lines += [
            "",
            "Correctness checks in the same run: "
            + ", ".join(f"{name} {yes(v)}" for name, v in checks.items()),
        ]
    for n in k.get("notes", []):
        lines.append(f"* {n}")
    return [*lines, ""], goals


def engine_section(e: dict | None) -> tuple[list[str], dict]:
    lines = ["## The engine on a training loop", ""]
    if not e:
        return [*lines, "(engine part produced nothing)", ""], {}
    methods = e.get("methods", {})
    any_model = next((m.get("model") for m in methods.values() if m.get("model")), {})
    probe = e.get("write_probe", {})
    every = next((m.get("every") for m in methods.values() if m.get("every")), None)
    lines += [
        f"Model: GPT, {any_model.get('layers')} layers, d={any_model.get('d')}, "
        f"vocab {any_model.get('vocab')}, {fmt(any_model.get('params'), 1, 1e-6)} M parameters, "
        f"batch {any_model.get('batch')} x {any_model.get('seq')} tokens; fp32 master weights, "
        f"bf16 autocast, fused fp32 AdamW: "
        f"{fmt(any_model.get('checkpoint_bytes_estimate'), 1, 1e-9)} GB of checkpoint. "
        f"A checkpoint every {every} iterations. Checkpoints in `{e.get('ckpt_root')}` "
        f"({e.get('ckpt_root_why')}; sequential write + fsync there: "
        f"{fmt(probe.get('gbps'))} GB/s).",
        "",
    ]
    comp: dict = {}
    rows = []
    for name, m in methods.items():
        if m.get("error"):
            rows.append([name, f"FAILED: {str(m['error'])[:150]}", *[""] * 9])
            continue
        s = m.get("summary", {})
        prof = m.get("profile") or {}
        first = s.get("first_save", {})
        iters = s.get("iter_s") if name == "none" else {"median": m.get("clean_iter_s"), "n": 1}
        rows.append(
            [
                name,
                spread(iters, 1, 1e3),
                fmt(s.get("overhead_vs_none"), 1, 100, " %"),
                spread(s.get("loop_stall_s"), 3),
                spread(s.get("engine_stall_s"), 3),
                spread(s.get("copy_s"), 2),
                spread(s.get("durable_s"), 1),
                fmt((s.get("window_overlap_fraction") or {}).get("median"), 0, 100, " %"),
                fmt(prof.get("overlap_fraction_of_copy"), 0, 100, " %"),
                fmt(m.get("rss_peak_bytes"), 1, 2**-30),
                fmt(first.get("loop_stall_s"), 2),
            ]
        )
        comp[name] = {
            "stall": (s.get("loop_stall_s") or {}).get("median"),
            "overhead": s.get("overhead_vs_none"),
            "overlap": prof.get("overlap_fraction_of_copy"),
        }
    columns = ["method", "iteration ms", "overhead vs none", "stall / ckpt s (loop)"]
    columns += ["stall / ckpt s (engine)", "copy s", "durable s", "copy overlapped (events)"]
    columns += ["copy overlapped (profiler)", "peak RSS GiB", "first save stall s"]
    lines += table_lines(columns, rows)
    rows = []
    for name, m in methods.items():
        s = m.get("summary", {})
        info = m.get("method_info") or {}
        pinned = (m.get("host_pinned_allocator") or {}).get("allocated_bytes.peak") or next(
            (v for k, v in (m.get("host_pinned_allocator") or {}).items() if "peak" in k), None
        )
        if "staging_pool_bytes" in info:
            staging = (
                f"pool {fmt(info.get('staging_pool_bytes'), 1, 2**-30)} GiB"
                f"{' pinned' if info.get('staging_pinned') else ''}"
            )
        elif "staging_options" in info:
            staging = "DefaultStager " + ", ".join(
                k.removeprefix("use_") for k, v in info["staging_options"].items() if v
            )
        else:
            staging = "–"
        rows.append(
            [
                name,
                fmt(s.get("checkpoint_bytes"), 2, 1e-9),
                len(s.get("per_save") or []),
                staging,
                fmt(pinned, 1, 2**-30),
                fmt(m.get("gpu_max_allocated_bytes"), 1, 2**-30),
                fmt(m.get("wall_s"), 0),
                m.get("exit_code"),
            ]
        )
    columns = ["method", "checkpoint GB", "measured saves", "staging"]
    columns += ["pinned host allocator peak GiB", "GPU max allocated GiB", "wall s", "exit"]
    lines += ["", *table_lines(columns, rows)]
    lines += [
        "",
        "Stall (loop): the save iteration and the next two, less 3x the run's median iteration "
        "before any save. Stall (engine): pcframe's own record (slot wait + optimizer-step "
        "gate); for DCP the async_save call + the pre-step wait for its staging. Overhead: "
        "mean iteration over the measured checkpoints' whole intervals against the "
        "no-checkpoint run's median. Copy overlapped: share of the copy's time during which "
        "forward/backward ran on the GPU (events: host timestamps vs CUDA-event windows; "
        "profiler: one extra checkpoint traced, D2H memcpys / Triton gather kernels vs other "
        "kernels).",
    ]
    for name, m in methods.items():
        for n in m.get("notes", []):
            lines.append(f"* {name}: {n}")
    for n in e.get("notes", []):
        lines.append(f"* {n}")
    return [*lines, ""], comp


def goals_section(kgoals: dict, comp: dict) -> list[str]:
    lines = ["## Goals", ""]
    copy_rows = {n: g for n, g in kgoals.items() if g[2] == "d2h" and "triton" in n}
    hbm_rows = {n: g for n, g in kgoals.items() if g[2] == "d2d"}
    if copy_rows:
        best = any_of([g[0] for g in copy_rows.values()])
        lines.append(f"* Triton copy >= 0.8x the D2H limit (API level, any copy row): {yes(best)}")
    if hbm_rows:
        api = all_of([g[0] for g in hbm_rows.values()])
        ko = all_of([g[1] for g in hbm_rows.values()])
        lines.append(
            f"* quantize / delta / checksum >= 0.7x HBM: API level {yes(api)}, "
            f"kernel only {yes(ko)}"
        )
    dcp = comp.get("dcp", {}).get("stall")
    for name in ("pcframe_torch", "pcframe_triton"):
        c = comp.get(name)
        if not c:
            continue
        le = None if dcp is None or c["stall"] is None else c["stall"] <= dcp
        ov = None if c["overhead"] is None else c["overhead"] <= GOAL_OVERHEAD
        lines.append(
            f"* {name}: stall <= DCP's {yes(le)}; overhead <= 3 % {yes(ov)}; "
            f"copy overlapped in the trace {fmt(c['overlap'], 0, 100, ' %')}"
        )
    return [*lines, ""]


def write(work: Path, out: Path, command: str) -> dict:
    parts = {n: read_json(work / f"{n}.json") for n in ("env", "tests", "kernels", "engine")}
    # a method whose process outlived the engine part's budget still left its own file
    for path in sorted(work.glob("engine_*.json")):
        method = path.stem[len("engine_") :]
        engine = parts["engine"] = parts["engine"] or {"methods": {}, "notes": []}
        if method not in engine.setdefault("methods", {}):
            data = read_json(path)
            if data:
                data.setdefault("notes", []).append("merged from its own file (part cut short)")
                engine["methods"][method] = data
    dry = any((p or {}).get("dry_run") for p in parts.values() if isinstance(p, dict))
    env = parts["env"] or {}
    device = (env.get("gpu") or {}).get("name", "no GPU")
    results = {
        "dry_run": dry,
        "device": device,
        "command": command,
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        **parts,
    }
    write_json(out / "results.json", results)
    title = "pcframe on a GPU" if not dry else "pcframe GPU benchmark: DRY RUN on CPU"
    lines = [f"# {title} ({device})", ""]
    if dry:
        lines += [
            "> **Dry run on a machine without a GPU: toy sizes, CPU tensors, Triton in "
            "its interpreter. These numbers measure nothing; they show that the script "
            "runs.**",
            "",
        ]
    lines += [
        f"Made by `{command}` on {results['written']}; every number below comes from that "
        "one run (full data in results.json).",
        "",
    ]
    lines += env_section(parts["env"])
    lines += tests_section(parts["tests"])
    ksec, kgoals = kernels_section(parts["kernels"])
    esec, comp = engine_section(parts["engine"])
    lines += goals_section(kgoals, comp) + ksec + esec
    write_results(out / "gpu_h200.md", "\n".join(lines) + "\n")
    return results
