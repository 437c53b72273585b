"""pcframe on an H200: tests, kernel bandwidths, the engine on a training loop (see README.md).

``run.sh`` calls the subcommands in turn, each under its own time budget:

    gpu_bench.py env     --work W            nvidia-smi, versions, machine (env.json, env.txt)
    gpu_bench.py tests-summary --work W      junit files -> tests.json, tests_junit.xml
    gpu_bench.py kernels --work W --budget S kernel bandwidths vs limits (kernels.json)
    gpu_bench.py engine  --work W --budget S one process per method (engine.json)
    gpu_bench.py train   --method M ...      one method's training loop (engine_M.json)
    gpu_bench.py report  --work W --out O    results.json + gpu_h200.md

``--dry-run`` runs everything on CPU at toy sizes (Triton through its interpreter).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from common import Budget, error_text, free_bytes, log, meminfo, read_json, write_json  # noqa: E402

DEFAULT_METHODS = ("none", "pcframe_torch", "pcframe_triton", "dcp")
# seconds per method inside the engine part's budget (scaled down if the part has less)
METHOD_BUDGET = {"none": 35, "pcframe_torch": 65, "pcframe_triton": 65, "dcp": 70}
DRY_METHOD_BUDGET = {"none": 25, "pcframe_torch": 35, "pcframe_triton": 45, "dcp": 35}


def sh(cmd: list[str] | str, timeout: float = 30) -> str:
    try:
        p = subprocess.run(
            cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout
        )
        return (p.stdout + p.stderr).strip()
    except Exception as exc:
        return f"({error_text(exc)})"


# --- env ---------------------------------------------------------------------------------


def cmd_env(args: argparse.Namespace) -> None:
    work = Path(args.work)
    info: dict = {"dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    info["uname"] = platform.uname()._asdict()
    info["cpus"] = os.cpu_count()
    mem = meminfo()
    info["mem_total_bytes"] = mem.get("MemTotal")
    info["mem_available_bytes"] = mem.get("MemAvailable")
    info["shm_free_bytes"] = free_bytes("/dev/shm")
    info["tmp_free_bytes"] = free_bytes("/tmp")
    info["python"] = sys.version.split()[0]
    versions = {}
    for mod in (
        "torch",
        "triton",
        "numba",
        "numpy",
        "xxhash",
        "crc32c",
        "zstandard",
        "hydra",
        "omegaconf",
        "optuna",
        "safetensors",
        "pytest",
    ):
        try:
            m = __import__(mod)
            versions[mod] = getattr(m, "__version__", "?")
        except Exception as exc:
            versions[mod] = f"missing ({type(exc).__name__})"
    info["versions"] = versions
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = {
                "name": p.name,
                "total_memory": p.total_memory,
                "multiprocessors": p.multi_processor_count,
                "capability": f"{p.major}.{p.minor}",
            }
        import pcframe

        info["pcframe"] = {"version": pcframe.__version__, "file": pcframe.__file__}
    except Exception as exc:
        info["import_error"] = error_text(exc)
    q = (
        "name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,"
        "pcie.link.width.current,pcie.link.width.max,clocks.sm,clocks.mem,power.draw,"
        "temperature.gpu,persistence_mode,compute_mode"
    )
    smi = shutil.which("nvidia-smi")
    info["nvidia_smi_query"] = sh([smi, f"--query-gpu={q}", "--format=csv"]) if smi else None
    info["git"] = sh(["git", "-C", str(REPO), "rev-parse", "HEAD"], 10)
    write_json(work / "env.json", info)
    parts = [
        "# environment",
        json.dumps(info, indent=2, default=str),
        "# nvidia-smi",
        sh([smi]) if smi else "(no nvidia-smi)",
        "# nvidia-smi -q",
        sh([smi, "-q"]) if smi else "",
        "# git status --short",
        sh(["git", "-C", str(REPO), "status", "--short"], 10),
        "# lscpu",
        sh(["lscpu"]),
        "# free -g",
        sh(["free", "-g"]),
        "# df -h",
        sh(["df", "-h", "/tmp", "/dev/shm", str(REPO)]),
        "# pip list",
        sh([sys.executable, "-m", "pip", "list", "--format=freeze"], 60),
    ]
    (work / "env.txt").write_text("\n\n".join(parts) + "\n")
    gpu = info.get("gpu", {}).get("name", "no CUDA device")
    log(f"env: {gpu}; torch {versions.get('torch')}, triton {versions.get('triton')}")


# --- tests -------------------------------------------------------------------------------


def cmd_tests_summary(args: argparse.Namespace) -> None:
    work = Path(args.work)
    suites = {}
    merged = ET.Element("testsuites")
    for name in args.suites:
        path = work / f"junit_{name}.xml"
        log_path = work / f"tests_{name}.log"
        entry: dict = {"junit": path.name, "log": log_path.name}
        rc_file = work / f"tests_{name}.rc"
        entry["exit_code"] = int(rc_file.read_text().strip()) if rc_file.exists() else None
        if entry["exit_code"] == 124:
            entry["timed_out"] = True
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as exc:
            entry["error"] = f"no junit xml ({error_text(exc)})"
            suites[name] = entry
            continue
        for suite in [root] if root.tag == "testsuite" else list(root):
            suite.set("name", f"{name}:{suite.get('name', 'pytest')}")
            merged.append(suite)
        counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
        failures, gpu_ran = [], []
        for case in root.iter("testcase"):
            cid = f"{case.get('classname', '')}::{case.get('name', '')}"
            kinds = {child.tag for child in case}
            if "failure" in kinds:
                counts["failed"] += 1
                failures.append(cid)
            elif "error" in kinds:
                counts["errors"] += 1
                failures.append(cid + " (error)")
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
                gpu_ran.append(cid)
        entry.update(counts)
        entry["failures"] = failures[:50]
        entry["time_s"] = sum(float(s.get("time", 0) or 0) for s in root.iter("testsuite"))
        if name == "gpu":
            entry["passed_ids"] = gpu_ran[:60]
        suites[name] = entry
        log(f"tests {name}: {counts} exit {entry['exit_code']}")
    ET.ElementTree(merged).write(work / "tests_junit.xml", encoding="utf-8", xml_declaration=True)
    write_json(work / "tests.json", suites)


# --- kernels -----------------------------------------------------------------------------


def cmd_kernels(args: argparse.Namespace) -> None:
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import kernel_bench

    kernel_bench.run(
        Path(args.work) / "kernels.json", args.budget, args.dry_run, args.size_mib, args.repeats
    )


# --- engine ------------------------------------------------------------------------------


def choose_root(need: int, forced: str | None, work: Path) -> tuple[Path, str]:
    if forced:
        return Path(forced), "given by --ckpt-root"
    candidates = [Path("/dev/shm"), Path("/tmp")]
    for c in candidates:
        if c.is_dir() and free_bytes(c) >= need:
            kind = "tmpfs (memory)" if c == Path("/dev/shm") else "disk"
            return c / "pcframe-gpu-bench", f"{kind}: {free_bytes(c) / 1e9:.0f} GB free"
    best = max(candidates, key=free_bytes)
    return best / "pcframe-gpu-bench", (
        f"WARNING: no place has {need / 1e9:.0f} GB free; using {best} "
        f"({free_bytes(best) / 1e9:.0f} GB free)"
    )


def write_probe(root: Path, nbytes: int) -> dict:
    """Sequential write + fsync bandwidth of the checkpoint directory, for context."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "probe.bin"
    block = os.urandom(16 << 20)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    os.remove(path)
    return {"bytes": written, "seconds": seconds, "gbps": written / seconds / 1e9}


def cmd_engine(args: argparse.Namespace) -> None:
    from train_bench import PRESETS

    work = Path(args.work)
    budget = Budget(args.budget)
    model = args.model or ("dry" if args.dry_run else "gpu")
    cfg = PRESETS[model]
    need = int(3.5 * cfg.checkpoint_bytes) + (1 << 30)
    root, why = choose_root(need, args.ckpt_root, work)
    result: dict = {
        "dry_run": args.dry_run,
        "model": model,
        "ckpt_root": str(root),
        "ckpt_root_why": why,
        "checkpoint_bytes_estimate": cfg.checkpoint_bytes,
        "methods": {},
        "notes": [],
    }
    log(
        f"engine: model {model} (~{cfg.checkpoint_bytes / 1e9:.2f} GB of checkpoint), "
        f"checkpoints in {root} ({why})"
    )
    try:
        result["write_probe"] = write_probe(root, (1 << 30) if not args.dry_run else (32 << 20))
    except Exception as exc:
        result["write_probe"] = {"error": error_text(exc)}
    write_json(work / "engine.json", result)
    table = DRY_METHOD_BUDGET if args.dry_run else METHOD_BUDGET
    methods = args.methods.split(",") if args.methods else list(DEFAULT_METHODS)
    planned = sum(table.get(m, 60) for m in methods)
    scale = min(1.0, (budget.left() - 5.0) / planned) if planned else 1.0
    baseline = None
    every = args.every or 0
    for i, m in enumerate(methods):
        # its share, plus what earlier methods left unused, less what later ones need
        rest = sum(table.get(x, 60) for x in methods[i + 1 :]) * scale
        share = table.get(m, 60) * scale
        b = min(budget.left() - 3.0, max(share, budget.left() - rest - 3.0))
        if b < 15.0:
            result["notes"].append(f"{m}: skipped, {budget.left():.0f} s left in the part")
            continue
        out = work / f"engine_{m}.json"
        cmd = [
            sys.executable,
            str(HERE / "gpu_bench.py"),
            "train",
            "--method",
            m,
            "--budget",
            f"{b:.0f}",
            "--out",
            str(out),
            "--model",
            model,
            "--ckpt-root",
            str(root),
            "--interval-s",
            str(args.interval_s),
            "--saves",
            str(args.saves),
            "--writers",
            str(args.writers),
        ]
        if every:
            cmd += ["--every", str(every)]
        if baseline:
            cmd += ["--baseline-iter-s", f"{baseline:.6f}"]
        if args.dry_run:
            cmd.append("--dry-run")
        if args.no_profile:
            cmd.append("--no-profile")
        log(f"engine: {m} (budget {b:.0f} s)")
        start = time.monotonic()
        try:
            rc = subprocess.run(cmd, timeout=b + 20, cwd=REPO).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
            result["notes"].append(f"{m}: killed after {b + 20:.0f} s (its budget + 20 s)")
        shutil.rmtree(root / m, ignore_errors=True)  # a killed method leaves its versions
        data = read_json(out) or {"error": "no result file"}
        data["exit_code"] = rc
        data["wall_s"] = time.monotonic() - start
        result["methods"][m] = data
        if m == "none" and data.get("summary"):
            baseline = data["summary"]["iter_s"]["median"]
            result["baseline_iter_s"] = baseline
            if not every:  # one interval in steps for every method: ~interval_s of training
                every = max(3, math.ceil(args.interval_s / baseline))
            result["every"] = every
        write_json(work / "engine.json", result)
    shutil.rmtree(root, ignore_errors=True)
    result["seconds"] = budget.used()
    write_json(work / "engine.json", result)


def cmd_train(args: argparse.Namespace) -> None:
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import train_bench

    args.profile = not args.no_profile
    if args.warmup is None:
        args.warmup = 2 if args.dry_run else 3
    if args.clean_steps is None:
        args.clean_steps = 5 if args.dry_run else 6
    train_bench.run(args, Path(args.out))


def cmd_report(args: argparse.Namespace) -> None:
    import report

    report.write(Path(args.work), Path(args.out), args.command)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--work", default=os.environ.get("WORK", "/tmp/gpu_work"))
        sp.add_argument("--dry-run", action="store_true")
        sp.add_argument("--budget", type=float, default=60.0, help="seconds for this part")

    sp = sub.add_parser("env")
    common(sp)
    sp.set_defaults(fn=cmd_env)
    sp = sub.add_parser("tests-summary")
    common(sp)
    sp.add_argument("--suites", nargs="+", default=["gpu", "kernels"])
    sp.set_defaults(fn=cmd_tests_summary)
    sp = sub.add_parser("kernels")
    common(sp)
    sp.add_argument("--size-mib", type=int, default=None)
    sp.add_argument("--repeats", type=int, default=None)
    sp.set_defaults(fn=cmd_kernels)
    sp = sub.add_parser("engine")
    common(sp)
    sp.add_argument(
        "--methods", default=None, help="comma list; default " + ",".join(DEFAULT_METHODS)
    )
    sp.add_argument("--model", default=None, help="gpu | small | dry")
    sp.add_argument("--ckpt-root", default=None)
    sp.add_argument("--interval-s", type=float, default=None)
    sp.add_argument("--every", type=int, default=0)
    sp.add_argument("--saves", type=int, default=None)
    sp.add_argument("--writers", type=int, default=4)
    sp.add_argument("--no-profile", action="store_true")
    sp.set_defaults(fn=cmd_engine)
    sp = sub.add_parser("train")
    common(sp)
    sp.add_argument("--method", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--model", default="gpu")
    sp.add_argument("--ckpt-root", required=True)
    sp.add_argument("--interval-s", type=float, default=6.0)
    sp.add_argument("--every", type=int, default=0)
    sp.add_argument("--saves", type=int, default=3)
    sp.add_argument("--writers", type=int, default=4)
    sp.add_argument("--baseline-iter-s", type=float, default=None)
    sp.add_argument("--warmup", type=int, default=None)
    sp.add_argument("--clean-steps", type=int, default=None)
    sp.add_argument("--none-steps", type=int, default=30)
    sp.add_argument("--no-profile", action="store_true")
    sp.set_defaults(fn=cmd_train)
    sp = sub.add_parser("report")
    common(sp)
    sp.add_argument("--out", required=True)
    sp.add_argument("--command", default="bash experiments/gpu/run.sh")
    sp.set_defaults(fn=cmd_report)
    args = p.parse_args(argv)
    if args.cmd == "engine":
        if args.interval_s is None:
            args.interval_s = 0.3 if args.dry_run else 6.0
        if args.saves is None:
            args.saves = 2 if args.dry_run else 3
    args.fn(args)


if __name__ == "__main__":
    main()
