"""What a lost node costs: 4 ranks as 2 nodes under torchrun, node b SIGKILLed, restarted.

    python experiments/recovery/run_recovery.py --out experiments/results/recovery.md
    python experiments/recovery/run_recovery.py --quick          # smoke run, about a minute

For each configuration, in the same run, in an order rotated every repeat:

* ``floor``: no checkpointing at all (neither pcframe nor s3fs imported); the restart trains
  from step 0 (what a restart costs at least);
* ``empty``: the floor of the goal, "a restart with nothing to load": the same job as
  ``peers`` (pcframe imported, the checkpointer opened with its peer tier and S3) over an
  empty root, memory folder and S3 prefix (the first incarnation saves nothing), so the
  restore finds nothing and the restart trains from step 0;
* ``remote``: pcframe, shards in the S3 server only (each node's root is a fresh folder per
  incarnation: nothing local survives; records and every shard come from S3);
* ``local``: pcframe, node-local roots + S3, ``replicas=0`` (node b's shards come from S3);
* ``peers``: pcframe, node-local roots + S3, ``replicas=1`` (node b's shards from the copies
  in node a's memory folder);
* ``dcp``: ``dcp.async_save`` through fsspec/s3fs to the same S3 server, ``dcp.load`` back;

the driver starts ``python -m torch.distributed.run --standalone --nproc-per-node 4
--max-restarts 1 experiments/recovery/worker.py ...`` (local ranks 0-1 are node a, 2-3 node b,
each node with its own root on disk and memory folder in /dev/shm), waits until rank 0 has
trained ``--kill-at`` steps (a checkpoint every ``--every``), SIGKILLs ranks 2 and 3, deletes
node b's root and memory folder (the VM is gone), and lets torchrun's agent restart all four
workers. They restore (or, for the floor, start afresh) and train ``--after`` steps. From the
workers' JSON logs (see worker.py) and the kill time:

* kill → first trained step, broken into restart (torchrun notices, stops the survivors,
  spawns; up to the last worker's first line), imports, rendezvous (``init_process_group``),
  setup (model + checkpointer open), the load (records/listing, fetch, read + verify, apply),
  the first step;
* lost steps: the step reached at the kill minus the step restored;
* bytes per tier: from the object store (pcframe's count of shard data, and every byte s3fs
  downloaded, listings included), sent between ranks, and the shard bytes each rank read per
  source (local disk, peer memory, fetched);
* bit-identity: a crc32c of each rank's whole state right after the restore against the
  uninterrupted incarnation's at the same step (4-rank DDP on gloo is not bit-reproducible
  across a process restart, so the state after further training is not compared);
* memory: peak RSS per rank, peak /dev/shm bytes of each rank's peer store, vs its budget.

Then a separate job (no kill) times training phases with local-only checkpoints and with peer
replication, alternating, ``--overhead-reps`` times (the overhead goal).

Everything runs on one machine: "nodes" share the CPUs, the "network" is loopback, and the S3
server (moto, :class:`pcframe.apps.tuning.loopback_s3.LoopbackS3`) competes for the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "experiments"))  # results_file
from results_file import command_line, header, table_lines, write_results  # noqa: E402

from pcframe.apps.tuning.loopback_s3 import LoopbackS3  # noqa: E402

WORKER = Path(__file__).with_name("worker.py")
CONFIGS = ["floor", "empty", "remote", "local", "peers", "dcp"]
LABELS = {
    "floor": "floor: no checkpointing at all",
    "empty": "floor: the same job, nothing to load",
    "remote": "remote only (S3)",
    "local": "local disk + remote",
    "peers": "peers + remote",
    "dcp": "DCP → S3 (fsspec)",
}
MIB = 1 << 20


# --- running one job -----------------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def model_args(args: argparse.Namespace) -> list[str]:
    out = []
    for name in ("vocab", "width", "layers", "heads", "seq", "batch", "every", "keep_last"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.peer_budget_mib:
        out += ["--peer-budget", str(int(args.peer_budget_mib * MIB))]
    return out


def torchrun(args: argparse.Namespace, restarts: int, worker_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        str(args.monitor_interval),
        str(WORKER),
        *worker_args,
    ]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO) + os.pathsep + e.get("PYTHONPATH", ""),
        # pytorch/pytorch#135712: with the rendezvous store shared, the restarted workers'
        # gloo groups read the previous attempt's addresses and fail to connect.
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    e.pop("PCFRAME_NODE", None)
    return e


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End the torchrun this driver started, and its workers (its own process group)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def clear_prefix(s3: LoopbackS3, prefix: str) -> None:
    client = s3.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    for i in range(0, len(keys), 1000):
        client.delete_objects(
            Bucket=s3.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]}
        )


def s3_listing(s3: LoopbackS3, prefix: str) -> dict[str, list[int]]:
    """What the S3 server holds of a run: committed shard versions per rank folder, global
    records, DCP checkpoints with their ``.metadata``."""
    client = s3.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix + "/")
    found: dict[str, list[int]] = {}
    for page in pages:
        for o in page.get("Contents", []):
            parts = o["Key"][len(prefix) + 1 :].split("/")
            try:
                if parts[0].startswith("rank-") and parts[-1] == "COMMITTED":
                    found.setdefault(parts[0], []).append(int(parts[1][1:]))
                elif parts[0] == "global" and parts[-1].endswith(".json"):
                    found.setdefault("global", []).append(int(parts[-1][1:-5]))
                elif parts[0].startswith("step-") and parts[-1] == ".metadata":
                    found.setdefault("dcp", []).append(int(parts[0][5:]))
            except ValueError:
                continue
    return {k: sorted(v) for k, v in found.items()}


def whole_in_s3(listing: dict[str, list[int]]) -> int:
    """The newest global version whose every shard is in the S3 server (DCP: checkpoint)."""
    if "dcp" in listing:
        return max(listing["dcp"])
    for version in sorted(listing.get("global", []), reverse=True):
        if all(version in listing.get(f"rank-{r}", []) for r in range(4)):
            return version
    return 0


def killed_run(
    config: str, rep: int, args: argparse.Namespace, s3: LoopbackS3, base: Path, shm_base: Path
) -> dict[str, Any]:
    """One job: train, kill node b at ``--kill-at``, restart, restore, train on."""
    run = base / f"{config}-{rep}"
    control, work, shm = run / "control", run / "work", shm_base / f"{config}-{rep}"
    for d in (control, work, shm):
        d.mkdir(parents=True, exist_ok=True)
    prefix = f"{config}-{rep}"
    worker_args = [
        "--config", config, "--work", str(work), "--shm", str(shm), "--control", str(control),
        "--steps", str(args.kill_at + args.wait_steps + 2 * args.every + 10),
        "--after", str(args.after),
        *model_args(args),
    ]  # fmt: skip
    if config != "floor":
        worker_args += ["--s3-url", s3.url(prefix), "--s3-endpoint", s3.endpoint]
    if args.no_fingerprint:
        worker_args.append("--no-fingerprint")
    log_path = run / "torchrun.log"
    result: dict[str, Any] = {"config": config, "rep": rep}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            torchrun(args, 1, worker_args),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env(),
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + args.timeout
        need_s3 = args.require_remote and config in ("remote", "local", "dcp")
        listed = 0.0
        while True:  # until rank 0 has trained --kill-at steps (and S3 holds a version)
            if proc.poll() is not None:
                raise RuntimeError(f"torchrun ended (rc {proc.returncode}) before the kill")
            if time.monotonic() > deadline:
                raise RuntimeError("no kill within --timeout")
            first = read_json(control / "inc0-r0.json")
            if first is not None and first.get("error"):
                raise RuntimeError(f"rank 0: {first['error']}")
            if first is not None and first["step"] >= args.kill_at:
                # Not forever: while the ranks' uploads lag by different amounts, S3 may hold
                # no whole version at all (see remote_retention_probe.py).
                if not need_s3 or first["step"] >= args.kill_at + args.wait_steps:
                    break
                if time.monotonic() - listed > 0.5:
                    listed = time.monotonic()
                    if whole_in_s3(s3_listing(s3, prefix)):
                        break
            time.sleep(0.01)
        pids = [read_json(control / f"inc0-r{r}.json")["pid"] for r in (2, 3)]
        t_kill = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        while not all(dead(pid) for pid in pids):
            time.sleep(0.002)
        t_dead = time.time()
        before = [read_json(control / f"inc0-r{r}.json") or {} for r in range(4)]
        # The VM is gone: node b's local disk and memory with it. Renamed out of the job's
        # sight, not deleted: a lost VM costs the survivors' CPUs nothing, and deleting its
        # files here (0.1-0.5 s of this machine's 2 cores) would land on the restart being
        # timed; the `finally` below deletes them with the rest.
        for folder in (work / "b", work / "b-inc0", shm / "b-shm"):
            with contextlib.suppress(FileNotFoundError):
                folder.rename(folder.with_name(f".gone-{folder.name}"))
        (control / "wiped-1").touch()
        t_wiped = time.time()
        if config != "floor":  # what the object store held then (the restart is under way)
            try:
                result["s3_at_kill"] = s3_listing(s3, prefix)
            except Exception as exc:
                result["s3_at_kill"] = {"error": [str(exc)]}
        try:
            rc = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            raise RuntimeError("the restarted job did not finish within --timeout") from None
        if rc != 0:
            raise RuntimeError(f"torchrun rc {rc}")
        after = [read_json(control / f"inc1-r{r}.json") for r in range(4)]
        if any(a is None for a in after):
            raise RuntimeError("a restarted rank left no log")
        result.update(
            t_kill=t_kill, kill_seconds=t_dead - t_kill, wipe_seconds=t_wiped - t_dead,
            before=before, after=after,
        )  # fmt: skip
        result.update(metrics(config, args, result))
    except Exception as exc:
        stop(proc)
        result["error"] = f"{exc}\n--- torchrun log ---\n{tail(log_path)}"
    finally:
        stop(proc)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        if config != "floor":
            try:
                clear_prefix(s3, prefix)
            except Exception as exc:
                result.setdefault("warnings", []).append(f"clearing s3 prefix: {exc}")
    return result


def metrics(config: str, args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    """The job-level numbers of one killed run (see the module docstring)."""
    before, after, t_kill = run["before"], run["after"], run["t_kill"]

    def last(name: str) -> float:  # the job moves at its slowest rank
        return max(a["t"][name] for a in after)

    restored = after[0]["restored_step"]
    reached = max(b.get("step", 0) for b in before)
    phases = [a.get("restore", {}).get("phases", {}) for a in after]

    def phase(name: str) -> float:
        return max(p.get(name, 0.0) for p in phases)

    out: dict[str, Any] = {
        "restored": restored,
        "reached": reached,
        "lost": reached - restored,
        "restart": last("start") - t_kill,
        "imports": last("imported") - last("start"),
        "rendezvous": last("init") - last("imported"),
        "setup": last("opened") - last("init"),
        "model": last("built") - last("init"),
        "open": last("opened") - last("built"),
        "load": last("restore_end") - last("opened"),
        "first_step": last("first_step") - last("train_begin"),
        "records": phase("records"),
        "fetch": phase("fetch"),
        "verify": phase("verify"),
        "apply": phase("apply") + phase("templates"),
        "wipe_wait": max(a.get("wipe_wait", 0.0) for a in after),
        "globals_at_kill": before[0].get("globals", []),
        "dcp_done_at_kill": before[0].get("dcp_done", []),
        "copied_at_kill": before[0].get("copied", []),
        "state_bytes": after[0].get("state_bytes", 0),
        "peer_budget": after[0].get("peer_budget", 0),
        "rss_peak_before": [b.get("rss_peak", 0) for b in before],
        "rss_peak_after": [a.get("rss_peak", 0) for a in after],
        "shm_peak_before": [b.get("shm_peak", 0) for b in before],
        "shm_peak_after": [a.get("shm_peak", 0) for a in after],
        "fetched_after": [a.get("fetched_bytes", 0) for a in after],
    }
    out["restart_rendezvous"] = out["restart"] + out["imports"] + out["rendezvous"]
    out["total"] = out["restart_rendezvous"] + out["setup"] + out["load"] + out["first_step"]
    out["fva"] = out["fetch"] + out["verify"] + out["apply"]
    out["load_other"] = max(
        out["load"] - out["records"] - out["fetch"] - out["verify"] - out["apply"], 0.0
    )
    restores = [a.get("restore", {}) for a in after]
    out["remote_bytes"] = sum(r.get("remote_bytes", 0) for r in restores)
    out["s3_read_bytes"] = sum(r.get("s3_read_bytes", 0) for r in restores)
    out["peer_bytes"] = sum(r.get("peer_bytes", 0) for r in restores)
    by_source: dict[str, int] = {}
    for r in restores:
        for kind, n in r.get("bytes_by_source", {}).items():
            by_source[kind] = by_source.get(kind, 0) + n
    out["bytes_by_source"] = by_source
    sizes = restores[0].get("shard_bytes", {})
    out["version_bytes"] = sum(sizes.values())
    out["lost_node_bytes"] = sum(n for r, n in sizes.items() if int(r) in (2, 3))
    # Shards no surviving root had (not on a local disk, not in a peer's memory): what the
    # object store must serve, each byte once across the job.
    held = {
        src for r in restores for src, kind in r.get("shard_sources", {}).items()
        if kind in ("local disk", "peer memory")
    }  # fmt: skip
    out["nowhere_bytes"] = sum(n for src, n in sizes.items() if src not in held)
    out["sources_rank0"] = restores[0].get("shard_sources", {})
    out["sources_rank2"] = restores[2].get("shard_sources", {})
    out["restore_error"] = restores[0].get("error", "")
    out["skipped"] = restores[0].get("skipped", [])
    out["passed_over"] = restores[0].get("lost", [])
    out.update(before_kill(before, run.get("s3_at_kill", {})))
    if config != "floor" and restored and not args.no_fingerprint:
        same = []
        for b, a in zip(before, after, strict=True):
            expected = b.get("fingerprints", {}).get(str(restored))
            same.append(expected is not None and expected == a.get("restored_fingerprint"))
        out["bit_identical"] = all(same)
        out["bit_identical_ranks"] = same
    return out


def before_kill(before: list[dict[str, Any]], s3_at_kill: dict[str, list[int]]) -> dict[str, Any]:
    """The first incarnation: its step time, and how long each version took from ``save()``
    to global, to its peer copies and to the object store (all ranks; to a step)."""
    stamps = before[0].get("step_times", [])
    diffs = [b - a for a, b in itertools.pairwise(stamps)][2:]  # after warm-up
    saves = [b.get("saves", {}) for b in before]

    def delay(key: str, ranks: list[dict[str, Any]]) -> list[float]:
        """Per rank and version it saved: ``save()`` until this rank saw ``key`` happen."""
        return [e[key] - e["t_save"] for r in ranks for e in r.values() if key in e]

    whole = whole_in_s3(s3_at_kill) if s3_at_kill and "error" not in s3_at_kill else None
    return {
        "step_time": statistics.median(diffs) if diffs else None,
        "to_global": delay("t_global", saves[:1]),
        "to_copied": delay("t_copied", saves),
        "to_remote": delay("t_remote", saves),
        "to_durable": delay("t_durable", saves[:1]),
        "whole_in_s3_at_kill": whole,
    }


def overhead_job(args: argparse.Namespace, base: Path, shm_base: Path) -> dict[str, Any]:
    """Training phases with local-only and with peer-replicated checkpoints, alternating."""
    run = base / "overhead"
    control, work, shm = run / "control", run / "work", shm_base / "overhead"
    for d in (control, work, shm):
        d.mkdir(parents=True, exist_ok=True)
    worker_args = [
        "--config", "overhead", "--work", str(work), "--shm", str(shm), "--control", str(control),
        "--reps", str(args.overhead_reps), "--phase-steps", str(args.phase_steps),
        "--variants", args.variants, *model_args(args),
    ]  # fmt: skip
    log_path = run / "torchrun.log"
    result: dict[str, Any] = {}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            torchrun(args, 0, worker_args),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env(),
            start_new_session=True,
        )
    try:
        rc = proc.wait(timeout=args.timeout * max(args.overhead_reps, 1))
        ranks = [read_json(control / f"inc0-r{r}.json") for r in range(4)]
        if rc != 0 or any(r is None for r in ranks):
            raise RuntimeError(f"torchrun rc {rc}")
        result["phases"] = ranks[0]["phases"]
        for i, phase in enumerate(result["phases"]):  # the job's CPU time: every rank's
            phase["job_cpu_seconds"] = sum(r["phases"][i].get("cpu_seconds", 0.0) for r in ranks)
            threads: dict[str, float] = {}
            for r in ranks:
                for name, seconds in r["phases"][i].get("cpu_by_thread", {}).items():
                    threads[name] = threads.get(name, 0.0) + seconds
            phase["job_cpu_by_thread"] = threads
        result["rss_peak"] = [r["rss_peak"] for r in ranks]
        result["shm_peak"] = [r["shm_peak"] for r in ranks]
        result["peer_budget"] = ranks[0]["peer_budget"]
    except Exception as exc:
        result["error"] = f"{exc}\n--- torchrun log ---\n{tail(log_path)}"
    finally:
        stop(proc)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return result


# --- the report ----------------------------------------------------------------------


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}..{fmt.format(max(values))})"


def mib(n: float) -> float:
    return n / MIB


def ok(flag: bool | None) -> str:
    return "–" if flag is None else ("**met**" if flag else "**not met**")


def report(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    overhead: dict[str, Any] | None,
    note: str,
    seconds: float,
    command: str | None = None,
) -> str:
    good = [r for r in runs if "error" not in r]
    by = {c: [r for r in good if r["config"] == c] for c in args.configs}
    state = next((r["state_bytes"] for r in good if r.get("state_bytes")), 0)
    budget = next((r["peer_budget"] for r in good if r.get("peer_budget")), 0)
    lines = header(
        "Recovery after a lost node (4 ranks as 2 nodes, torchrun)", command or command_line(), note
    )
    lines += [
        f"A GPT of {args.layers} layers, width {args.width}, vocabulary {args.vocab} "
        f"(DDP over gloo, AdamW): **{mib(state):.1f} MiB of checkpointed state** (weights + "
        f"two moments, each replicated tensor written once across the ranks; every rank holds "
        f"all of it). A checkpoint every {args.every} steps; node b (ranks 2, 3) SIGKILLed once "
        f"rank 0 has trained {args.kill_at} steps"
        + (
            " and, for the configurations that need it (remote only, local disk + remote, "
            "DCP), the S3 server holds a whole version (at most "
            f"{args.wait_steps} steps later; the floor and peers: at step {args.kill_at})"
            if args.require_remote
            else ""
        )
        + ", its root and memory folder deleted, "
        f"torchrun (`--max-restarts 1`) restarts all four workers, which restore and train "
        f"{args.after} step(s). {args.repeats} repeat(s) of every configuration, in an order "
        f"rotated each repeat; cells are median (min..max) over the repeats. Peer budget "
        f"{mib(budget):.0f} MiB per rank. Whole benchmark: {seconds / 60:.1f} min.",
        "",
    ]
    failed = [r for r in runs if "error" in r]
    if failed:
        lines += [f"**{len(failed)} run(s) failed** (not in the tables):", ""]
        for r in failed:
            first = r["error"].splitlines()[0] if r["error"] else "?"
            lines.append(f"* {LABELS.get(r['config'], r['config'])}, repeat {r['rep']}: {first}")
        lines.append("")

    # --- goals ---
    goals = goal_rows(args, by, budget, overhead)
    met = [g[0] for g in goals if g[3] == ok(True)]
    missed = [g[0] for g in goals if g[3] == ok(False)]
    lines += ["## Goals", ""]
    lines += [
        f"**{len(met)} of {len(met) + len(missed)} goals met in this run.**"
        + (" Not met: " + "; ".join(missed) + "." if missed else ""),
        "",
    ]
    lines += table_lines(["goal", "target", "measured", ""], goals, "lllc")
    lines += [
        "",
        "Ratios are taken per repeat between configurations of the same round, then the median "
        "(min..max) of those. A run in which no version could be restored (the newest global "
        "versions' shards were nowhere: `NoValidCheckpoint`, the restarted job then trains from "
        "step 0) counts with 0 bytes and its full lost steps.",
        "",
    ]

    # --- time ---
    lines += ["## Kill to first trained step (seconds)", ""]
    cols = [
        ("total", "kill → first step"),
        ("restart_rendezvous", "restart + rendezvous"),
        ("restart", "of which restart"),
        ("imports", "imports"),
        ("rendezvous", "rendezvous"),
        ("model", "model + optimizer"),
        ("open", "checkpointer open"),
        ("load", "load (the restore call)"),
        ("records", "records / listing"),
        ("fetch", "fetch"),
        ("verify", "read + verify"),
        ("apply", "apply"),
        ("first_step", "first step"),
    ]
    rows = []
    for c in args.configs:
        if by[c]:
            rows.append(
                [LABELS[c], str(len(by[c]))] + [spread([r[k] for r in by[c]]) for k, _ in cols]
            )
    lines += table_lines(
        ["configuration", "n"] + [t for _, t in cols], rows, "lr" + "r" * len(cols)
    )
    lines += [
        "",
        "Restart: from the SIGKILL until the last new worker's first line (torchrun notices the "
        "failure, stops the survivors, spawns four processes). Imports: python + torch + pcframe. "
        "Rendezvous: `init_process_group`. Model + optimizer: built (DDP's initial broadcast "
        "included). Checkpointer open: its process groups, the engine, the ranks' agreement "
        "(DCP: its gloo group and s3fs). Load: the restore call; for "
        "pcframe its phases are timed inside pcframe (records: listing the global records in "
        "every root and the object store; fetch: bringing each root the shards it lacks; read + "
        "verify: reading what each rank needs, every chunk's checksum checked; apply: into the "
        "live objects), each the slowest rank's, so they need not add up to the load. DCP: "
        "listing = finding the newest checkpoint with `.metadata`; fetch = `dcp.load` (reads "
        "and copies in place; DCP verifies nothing); apply = `get_state_dict` templates + "
        "`set_state_dict`. Each column is the slowest rank's time.",
        "",
    ]

    # --- lost steps and bytes ---
    lines += ["## Lost steps and bytes read per tier", ""]
    rows = []
    for c in args.configs:
        rs = by[c]
        if not rs:
            continue
        src = lambda r, k: r["bytes_by_source"].get(k, 0)  # noqa: E731
        rows.append(
            [
                LABELS[c],
                spread([r["reached"] for r in rs], "{:.0f}"),
                spread([r["restored"] for r in rs], "{:.0f}"),
                spread([r["lost"] for r in rs], "{:.0f}"),
                spread([mib(r["remote_bytes"]) for r in rs], "{:.1f}"),
                spread([mib(r["s3_read_bytes"]) for r in rs], "{:.1f}"),
                spread([mib(r["peer_bytes"]) for r in rs], "{:.1f}"),
                spread([mib(src(r, "local disk")) for r in rs], "{:.0f}"),
                spread([mib(src(r, "peer memory")) for r in rs], "{:.0f}"),
                spread([mib(src(r, "fetched")) for r in rs], "{:.0f}"),
                bit_cell(rs),
            ]
        )
    lines += table_lines(
        [
            "configuration",
            "step at kill",
            "restored step",
            "lost steps",
            "object store: shard data (MiB)",
            "object store: all s3fs reads (MiB)",
            "sent between ranks (MiB)",
            "read from local disk (MiB)",
            "read from peer memory (MiB)",
            "read from fetched copies (MiB)",
            "restored state = uninterrupted run's",
        ],
        rows,
        "lrrrrrrrrrl",
    )
    lines += [
        "",
        "Object store, shard data: pcframe's count of shard bytes downloaded (the restore "
        "report's `remote_bytes`, all ranks); all s3fs reads: every byte s3fs downloaded during "
        "the restore in the workers (listings, commit markers, records included; for DCP "
        "everything `dcp.load` read). Sent between ranks: `peer_bytes`, the shards a rank "
        "received from another (from its disk, its peer memory, or a download it passed on). "
        "Read from ...: per rank, the stored bytes of each shard of the restored version by "
        "where that rank read it (`shard_sources`), summed over the 4 ranks (every rank reads "
        "nearly every shard: the state is replicated). Bit identity: each rank's state (model, "
        "optimizer, scheduler, RNG, data position) right after the restore has the same crc32c "
        "as the uninterrupted incarnation's right after it saved that step.",
        "",
    ]

    # --- before the kill ---
    lines += ["## The job before the kill", ""]
    rows = []
    for c in args.configs:
        rs = by[c]
        if not rs:
            continue

        def flat(key: str, rs: list[dict[str, Any]] = rs) -> list[float]:
            return [v for r in rs for v in r.get(key, [])]

        rows.append(
            [
                LABELS[c],
                spread([r["step_time"] for r in rs if r.get("step_time")]),
                spread(flat("to_global") or flat("to_durable")),
                spread(flat("to_copied")),
                spread(flat("to_remote")),
                spread(
                    [
                        r["whole_in_s3_at_kill"]
                        for r in rs
                        if r.get("whole_in_s3_at_kill") is not None
                    ],
                    "{:.0f}",
                ),
            ]
        )
    lines += table_lines(
        [
            "configuration",
            "step time (s)",
            "save() → global (DCP: → durable) (s)",
            "save() → a rank's shard copied to the other node (s)",
            "save() → a rank's shard in the object store (s)",
            "newest version whole in S3 at the kill (DCP: step)",
        ],
        rows,
        "lrrrrr",
    )
    lines += [
        "",
        "From the first incarnation's logs, to the step (each rank looks once per step): the "
        "median time between steps (checkpoint steps included), and per saved version the time "
        "from `save()` until rank 0 saw it global, and per rank and version until that rank's "
        "shard had its peer copy (`peers.status.copied`) or its remote tier had written it "
        "(`tiers.status()['remote'].last_written`; versions the one-slot mailbox skipped, and "
        "those still on their way at the kill, do not count). The last column lists the S3 "
        "server right after the kill.",
        "",
    ]

    # --- memory ---
    lines += ["## Memory", ""]
    rows = []
    for c in args.configs:
        rs = by[c]
        if not rs:
            continue
        rows.append(
            [
                LABELS[c],
                spread([mib(max(r["rss_peak_before"])) for r in rs], "{:.0f}"),
                spread([mib(max(r["rss_peak_after"])) for r in rs], "{:.0f}"),
                spread([mib(max(r["shm_peak_before"])) for r in rs], "{:.0f}"),
                spread([mib(max(r["shm_peak_after"])) for r in rs], "{:.0f}"),
                spread([mib(max(r.get("fetched_after") or [0])) for r in rs], "{:.0f}"),
            ]
        )
    lines += table_lines(
        [
            "configuration",
            "peak RSS, largest rank, before the kill (MiB)",
            "after the restart (MiB)",
            "peak /dev/shm of a rank's peer store, before (MiB)",
            "after (MiB)",
            "fetched shards kept in a node's memory after the restore (MiB)",
        ],
        rows,
        "lrrrrr",
    )
    lines += [
        "",
        "With a peer tier, a restore fetches the shards a node lacks into its memory folder "
        "and keeps the restored version's there (a second restart on that node reads them "
        "without fetching): node b holds the whole version after the restore, outside "
        "`peer_budget`. "
        f"Budget for peer copies: {mib(budget):.0f} MiB per rank (`peer_budget`). The extra "
        "RSS of peer replication is the peers row's peak RSS minus the local-disk row's (same "
        "job otherwise); /dev/shm is sampled every 50 ms.",
        "",
    ]

    # --- overhead ---
    lines += ["## Training overhead of peer replication", ""]
    if overhead is None:
        lines += ["Not run (`--overhead-reps 0`).", ""]
    elif "error" in overhead:
        lines += ["The overhead job failed:", "", "```", overhead["error"][-2000:], "```", ""]
    else:
        lines += overhead_lines(args, overhead)

    # --- notes ---
    rates = [mib(r["remote_bytes"]) / r["fetch"] for r in by.get("remote", []) if r["fetch"] > 0]
    rate = f"the remote-only restore fetched at {spread(rates, '{:.0f}')} MiB/s" if rates else ""
    lines += [
        "## How to read this",
        "",
        "* Both nodes, the S3 server and torchrun share this machine's cores: the object store's "
        f"bandwidth (moto on loopback, CPU-bound{': ' + rate if rate else ''}) and the 'network' "
        "between nodes (gloo over loopback) are not a datacenter's; the ratios between "
        "configurations of one round are the result, the absolute seconds are this machine's.",
        "* The kill waits until rank 0 has trained `--kill-at` steps and, for the "
        "configurations that restore from the object store (remote only, local disk + remote, "
        "DCP), until the S3 server holds a whole version (`--require-remote`; every shard of a "
        "global record, or a DCP checkpoint's `.metadata`): otherwise a restore could find "
        "nothing to load from it and their numbers would measure nothing (the "
        f"wait ends {args.wait_steps} steps after `--kill-at` in any case). So the step at the "
        "kill differs between runs; lost steps are counted from it.",
        "* The first incarnation also computes a crc32c of each rank's whole state after every "
        "save (for the bit-identity check), which lengthens its checkpoint steps a little; the "
        "restarted incarnation computes one after the restore, outside the timed phases.",
        "* DCP: `dcp.async_save` (thread, staged copy) every interval, one save in flight, with "
        "`FsspecWriter` (s3fs defaults) to `<prefix>/step-N`; restore: the newest folder with "
        "`.metadata`, `dcp.load` with `FsspecReader`, `set_state_dict`. Each DDP rank loads the "
        "whole state, so it reads about 4x the checkpoint from S3, and s3fs's read-ahead "
        "fetches more than that.",
        "",
    ]

    # --- raw ---
    lines += ["## Every run", ""]
    rows = []
    for r in good:
        rows.append(
            [
                LABELS[r["config"]],
                str(r["rep"]),
                f"{r['reached']} → {r['restored']}",
                ",".join(str(v) for v in r["globals_at_kill"] or r["dcp_done_at_kill"]) or "–",
                ",".join(str(v) for v in r["copied_at_kill"]) or "–",
                f"{r['total']:.2f}",
                f"{r['load']:.2f}",
                f"{mib(r['remote_bytes']):.1f}",
                f"{mib(r['peer_bytes']):.1f}",
                "–" if r.get("whole_in_s3_at_kill") is None else str(r["whole_in_s3_at_kill"]),
                sources(r),
                "; ".join(f"v{v}: {why[:80]}" for v, why in r["skipped"] + r["passed_over"])
                + (
                    f" **no version restorable**: {r['restore_error'][:160]}"
                    if r["restore_error"]
                    else ""
                )
                or "–",
            ]
        )
    lines += table_lines(
        [
            "configuration",
            "repeat",
            "steps (kill → restored)",
            "global versions at kill (DCP: saved steps)",
            "peer-copied at kill",
            "kill → first step (s)",
            "load (s)",
            "object store (MiB)",
            "sent (MiB)",
            "whole in S3 at kill",
            "rank 0 / rank 2 read shards 0-3 from",
            "skipped / passed over",
        ],
        rows,
        "lrlllrrrrrll",
    )
    lines += [
        "",
        "Shards 0-3 read from: L local disk, P a peer copy in this node's memory, F fetched by "
        "this restore (sent by another rank, or downloaded from S3 by this one), S object store.",
        "",
    ]
    return "\n".join(lines)


def sources(r: dict[str, Any]) -> str:
    short = {"local disk": "L", "peer memory": "P", "fetched": "F", "object store": "S"}

    def one(s: dict[str, str]) -> str:
        return "".join(short.get(s.get(str(k), ""), "-") for k in range(4))

    if not r["sources_rank0"]:
        return "–"
    return f"{one(r['sources_rank0'])} / {one(r['sources_rank2'])}"


def bit_cell(rs: list[dict[str, Any]]) -> str:
    flags = [r.get("bit_identical") for r in rs if "bit_identical" in r]
    if not flags:
        return "–"
    return f"{sum(flags)}/{len(flags)} runs bit-identical"


def paired(by: dict[str, list[dict[str, Any]]], a: str, b: str, key: str) -> list[float]:
    """Per repeat, ``a``'s ``key`` over ``b``'s (the two ran in the same round)."""
    bs = {r["rep"]: r for r in by.get(b, [])}
    return [
        r[key] / bs[r["rep"]][key] for r in by.get(a, []) if r["rep"] in bs and bs[r["rep"]][key]
    ]


def goal_rows(
    args: argparse.Namespace,
    by: dict[str, list[dict[str, Any]]],
    budget: int,
    overhead: dict[str, Any] | None,
) -> list[list[str]]:
    rows = []
    peers, local, remote = by.get("peers", []), by.get("local", []), by.get("remote", [])
    if peers:
        zero = all(r["remote_bytes"] == 0 for r in peers)
        rows.append(
            [
                "one node lost, one replica: checkpoint data from the object store",
                "0 bytes",
                f"{spread([mib(r['remote_bytes']) for r in peers], '{:.1f}')} MiB "
                f"(all s3fs reads incl. listings: "
                f"{spread([mib(r['s3_read_bytes']) for r in peers], '{:.2f}')} MiB)",
                ok(zero),
            ]
        )
        flags = [r.get("bit_identical") for r in peers if "bit_identical" in r]
        rows.append(
            [
                "one node lost, one replica: restored state bit-identical to the uninterrupted "
                "run's at that step",
                "every rank, every run",
                f"{sum(flags)}/{len(flags)} runs" if flags else "not checked",
                ok(all(flags) if flags else None),
            ]
        )
        rows.append(
            [
                "one node lost, one replica: lost work",
                f"≤ one interval ({args.every} steps)",
                f"{spread([r['lost'] for r in peers], '{:.0f}')} steps",
                ok(all(r["lost"] <= args.every for r in peers)),
            ]
        )
    for rs, what in (
        (local, "both copies of a shard lost (local disk + remote, no peer copy)"),
        (remote, "nothing local survives (remote only)"),
    ):
        rs = [r for r in rs if r["restored"]]
        if not rs:
            continue
        once = all(r["remote_bytes"] == r["nowhere_bytes"] for r in rs)
        rows.append(
            [
                f"{what}: the object store serves every shard no surviving root holds, each "
                "byte read once across the job",
                "object-store bytes = bytes of those shards",
                f"{spread([mib(r['remote_bytes']) for r in rs], '{:.1f}')} MiB read vs "
                f"{spread([mib(r['nowhere_bytes']) for r in rs], '{:.1f}')} MiB of such shards "
                f"(node b's: {spread([mib(r['lost_node_bytes']) for r in rs], '{:.1f}')}; the "
                f"version: {spread([mib(r['version_bytes']) for r in rs], '{:.1f}')})",
                ok(once),
            ]
        )

    def ratio_row(what: str, ratios: list[float], at_most: float | None = None) -> None:
        """A row of per-repeat ratios: a goal (``at_most``) or, without one, a reference."""
        if not ratios:
            return
        if at_most is None:
            rows.append([f"(for reference) {what}", "–", f"{spread(ratios)}x", "–"])
        else:
            met = ok(statistics.median(ratios) <= at_most)
            rows.append([what, f"≤ {at_most}x", f"{spread(ratios)}x", met])

    ratio_row(
        "load phase (fetch + read/verify + apply, slowest rank each) from peers ÷ from the "
        "object store (remote only), paired per repeat",
        paired(by, "peers", "remote", "fva"),
        0.3,
    )
    for other, what in (("remote", "remote only"), ("local", "local disk + remote")):
        ratio_row(
            f"the whole restore call (listing included) with peers ÷ {what}",
            paired(by, "peers", other, "load"),
        )
    ratio_row("DCP's restore call ÷ pcframe's with peers", paired(by, "dcp", "peers", "load"))
    # The goal's floor is "a restart with nothing to load"; it is read two ways, both scored:
    # a job without checkpointing at all (the stricter, this benchmark's first yardstick),
    # and the same job restarting with nothing to load (pcframe imported and opened).
    for floor, what in (
        ("floor", "a job without pcframe (no checkpointing: neither pcframe nor s3fs imported)"),
        ("empty", "the same job restarting with nothing to load (pcframe imported and opened "
         "with its peer tier and S3, nothing saved yet)"),
    ):  # fmt: skip
        ratio_row(
            f"kill → first step with peers ÷ the floor: {what}",
            paired(by, "peers", floor, "total"),
            1.3,
        )
    for config in ("remote", "local", "dcp"):
        ratio_row(
            f"kill → first step, {LABELS[config]} ÷ the same job with nothing to load",
            paired(by, config, "empty", "total"),
        )
    ratio_row(
        "kill → first step, the same job with nothing to load ÷ a job without pcframe "
        "(importing pcframe and s3fs, opening the checkpointer)",
        paired(by, "empty", "floor", "total"),
    )
    if peers and local and budget:
        shm = max(max(r["shm_peak_before"] + r["shm_peak_after"]) for r in peers)
        extra = statistics.median(max(r["rss_peak_before"]) for r in peers) - statistics.median(
            max(r["rss_peak_before"]) for r in local
        )
        held = shm + max(extra, 0)
        rows.append(
            [
                "peak host memory held for peer copies (largest /dev/shm use of a rank's store "
                "+ extra peak RSS of the peers run over the local run)",
                f"≤ budget ({mib(budget):.0f} MiB per rank)",
                f"{mib(held):.0f} MiB ({mib(shm):.0f} shm + {mib(extra):.0f} RSS)",
                ok(held <= budget),
            ]
        )
    if overhead and "phases" in overhead:
        ratios = overhead_ratios(overhead, "peers", "local")
        if ratios:
            rows.append(
                [
                    "training with peer replication at every checkpoint ÷ local checkpoints "
                    "only, paired per round",
                    "≤ 1.05x",
                    f"{spread(ratios, '{:.3f}')}x",
                    ok(statistics.median(ratios) <= 1.05),
                ]
            )
    return rows


def overhead_ratios(overhead: dict[str, Any], a: str, b: str, key: str = "seconds") -> list[float]:
    by: dict[int, dict[str, float]] = {}
    for p in overhead["phases"]:
        if key in p:
            by.setdefault(p["rep"], {})[p["variant"]] = p[key]
    return [v[a] / v[b] for v in by.values() if a in v and b in v and v[b]]


def thread_lines(overhead: dict[str, Any], variants: list[str]) -> list[str]:
    """Where the job's CPU time went, by thread, per variant (median over the phases)."""
    phases = {v: [p for p in overhead["phases"] if p["variant"] == v] for v in variants}
    names = sorted(
        {n for ph in phases.values() for p in ph for n in p.get("job_cpu_by_thread", {})},
        key=lambda n: (
            -max(
                statistics.median([p.get("job_cpu_by_thread", {}).get(n, 0.0) for p in ph] or [0])
                for ph in phases.values()
            )
        ),
    )
    if not names:
        return []
    rows = [
        [f"`{name}`"]
        + [
            spread([p.get("job_cpu_by_thread", {}).get(name, 0.0) for p in phases[v]], "{:.2f}")
            for v in variants
        ]
        for name in names
    ]
    return [
        "",
        "CPU time of the 4 ranks' threads in a phase (without its close), by thread name (s):",
        "",
        *table_lines(["thread", *variants], rows, "l" + "r" * len(variants)),
    ]


def overhead_lines(args: argparse.Namespace, overhead: dict[str, Any]) -> list[str]:
    variants = [v for v in args.variants.split(",") if v]
    rows = []
    for v in variants:
        ph = [p for p in overhead["phases"] if p["variant"] == v]
        saves = max(0, (args.phase_steps - args.every) // args.every)
        rows.append(
            [
                v,
                str(len(ph)),
                spread([p["seconds"] for p in ph]),
                spread([p["seconds"] / args.phase_steps for p in ph], "{:.3f}"),
                spread([p["close_seconds"] for p in ph]),
                spread([p.get("job_cpu_seconds", 0.0) for p in ph], "{:.1f}"),
                str(saves) if v != "none" else "0",
            ]
        )
    lines = table_lines(
        [
            "variant",
            "phases",
            f"{args.phase_steps} steps (s)",
            "per step (s)",
            "close (s)",
            "CPU time of the 4 ranks, phase + close (s)",
            "saves",
        ],
        rows,
        "lrrrrrr",
    )
    lines += [""]
    for v in variants:
        if v != "local" and "local" in variants:
            r = overhead_ratios(overhead, v, "local")
            if r:
                lines.append(f"* {v} ÷ local, per round: {spread(r, '{:.3f}')}x")
            r = overhead_ratios(overhead, v, "local", "job_cpu_seconds")
            if r:
                lines.append(
                    f"* {v} ÷ local, CPU time of the job per round: {spread(r, '{:.3f}')}x "
                    "(where the training keeps every core busy, the wall-clock ratio tends to "
                    "this; other load on the machine moves it less)"
                )
    lines += thread_lines(overhead, variants)
    lines += [
        "",
        f"One job (no kill), the variants alternating in each of {args.overhead_reps} rounds "
        f"(order reversed every other round), after 2 untimed warm-up steps. A phase opens a "
        f"checkpointer, trains {args.phase_steps} steps with a save every {args.every} (none in "
        f"the last {args.every}, so every save has {args.every} timed steps after it), and is "
        "timed from a barrier to a barrier; `close()` (finishing the last rounds) is timed "
        "apart. local: `replicas=0`; peers: `replicas=1` (each global version copied to the "
        "other node's memory folder). Neither uploads to S3. Peak /dev/shm of a rank's store: "
        f"{mib(max(overhead['shm_peak'])):.0f} MiB (budget {mib(overhead['peer_budget']):.0f}).",
        "",
    ]
    return lines


# --- main ----------------------------------------------------------------------------


def describe(result: dict[str, Any]) -> str:
    """One line on a killed run, for the progress log."""
    if "error" in result:
        return "FAILED: " + result["error"].splitlines()[0]
    line = (
        f"kill→first step {result['total']:.2f} s, load {result['load']:.2f} s, "
        f"lost {result['lost']}, S3 {mib(result['remote_bytes']):.1f} MiB, "
        f"peers {mib(result['peer_bytes']):.1f} MiB"
    )
    if "bit_identical" in result:
        line += f", bit-identical {result['bit_identical']}"
    return line


QUICK = dict(
    vocab=2048, width=256, layers=2, heads=4, seq=16, batch=2, every=3, kill_at=8, after=1,
    repeats=1, overhead_reps=1, phase_steps=6, timeout=240.0,
)  # fmt: skip


def compile_bytecode() -> None:
    """pcframe's and the worker's bytecode written once before any timing, as a pip install
    (or any earlier import) leaves it: torch and s3fs come with theirs, and this checkout is
    installed in place (``pip install -e``) where PYTHONDONTWRITEBYTECODE may be set, which
    would otherwise charge compiling pcframe to every restart's imports."""
    import compileall

    for folder in (REPO / "pcframe", WORKER.parent):
        compileall.compile_dir(str(folder), quiet=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (about a minute)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--every", type=int, default=3, help="a checkpoint every N steps")
    parser.add_argument("--kill-at", type=int, default=8, help="kill once rank 0 trained N steps")
    parser.add_argument("--after", type=int, default=1, help="steps trained after the restart")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--peer-budget-mib", type=float, default=0.0, help="0: 2.5x a rank's share")
    parser.add_argument("--overhead-reps", type=int, default=5)
    parser.add_argument("--phase-steps", type=int, default=9, help="overhead: steps per phase")
    parser.add_argument("--variants", default="local,peers", help="overhead phases (none too)")
    parser.add_argument("--monitor-interval", type=float, default=0.1, help="torchrun's")
    parser.add_argument("--no-fingerprint", action="store_true")
    parser.add_argument(
        "--require-remote",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kill only once the S3 server holds a whole version (every config but the floor), "
        "so every restore has one to load",
    )
    parser.add_argument(
        "--wait-steps",
        type=int,
        default=6,
        help="with --require-remote, kill anyway this many steps after --kill-at",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--dir", default=None, help="scratch on disk (default: a temp dir)")
    parser.add_argument("--shm", default="/dev/shm", help="where the nodes' memory folders go")
    parser.add_argument("--keep", action="store_true", help="keep the logs in the scratch dir")
    parser.add_argument("--out", default=None)
    parser.add_argument("--report-only", metavar="RAW", help="rewrite --out from a raw.json")
    args = parser.parse_args()
    if args.report_only:
        saved = json.loads(Path(args.report_only).read_text())
        for key, value in saved["args"].items():
            if key not in ("out", "report_only"):
                setattr(args, key, value)
        out = args.out or "experiments/results/recovery.md"
        for run in saved["runs"]:  # the numbers again, from the logs kept in raw.json
            if "error" not in run:
                run.update(metrics(run["config"], args, run))
        text = report(
            args,
            saved["runs"],
            saved["overhead"],
            saved.get("note", ""),
            saved.get("seconds", 0),
            saved.get("command"),
        )
        write_results(out, text)
        print(f"wrote {out}")
        return
    given = {a.lstrip("-").replace("-", "_").split("=")[0] for a in sys.argv[1:]}
    if args.quick:
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; choose from {CONFIGS}")
    if args.kill_at <= args.every:
        parser.error("--kill-at must come after the first checkpoint (> --every)")
    out = args.out or (
        "/tmp/recovery-quick.md" if args.quick else "experiments/results/recovery.md"
    )

    compile_bytecode()
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="recovery-", dir=args.dir))
    shm_base = Path(tempfile.mkdtemp(prefix="pcframe-recovery-", dir=args.shm))
    load_before = os.getloadavg()
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    overhead = None
    try:
        with LoopbackS3(bucket="recovery") as s3:
            for rep in range(args.repeats if args.configs else 0):
                order = (
                    args.configs[rep % len(args.configs) :]
                    + args.configs[: rep % len(args.configs)]
                )
                for config in order:
                    t = time.monotonic()
                    result = killed_run(config, rep, args, s3, base, shm_base)
                    runs.append(result)
                    status = describe(result)
                    print(
                        f"[{(time.monotonic() - started) / 60:5.1f} min] repeat {rep} "
                        f"{config:6s} ({time.monotonic() - t:.0f} s): {status}",
                        flush=True,
                    )
                    if "error" in result and args.quick:
                        print(result["error"], file=sys.stderr)
        if args.overhead_reps > 0:
            t = time.monotonic()
            overhead = overhead_job(args, base, shm_base)
            ratios = overhead_ratios(overhead, "peers", "local") if "phases" in overhead else []
            said = f"peers/local {spread(ratios, '{:.3f}')}" if ratios else overhead.get("error")
            minutes = (time.monotonic() - started) / 60
            print(
                f"[{minutes:5.1f} min] overhead ({time.monotonic() - t:.0f} s): {said}", flush=True
            )
    finally:
        shutil.rmtree(shm_base, ignore_errors=True)
        raw = base / "raw.json"
        saved = {"runs": runs, "overhead": overhead, "args": vars(args), "command": command_line()}
        raw.write_text(json.dumps(saved, indent=1, default=str))
        print(f"raw results: {raw}")
    load_after = os.getloadavg()
    note = (
        f"{os.cpu_count()} CPU cores shared by the 4 ranks, torchrun and the S3 server (moto on "
        f"loopback); {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / (1 << 30):.0f} "
        f"GiB RAM; both 'nodes' on this one machine ({platform.node()}); load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    raw.write_text(json.dumps({**saved, "note": note, "seconds": time.monotonic() - started}))
    text = report(args, runs, overhead, note, time.monotonic() - started)
    write_results(out, text)
    print(f"wrote {out}")
    if not args.keep and not any("error" in r for r in runs):
        for child in base.iterdir():  # the runs' logs; raw.json stays
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
        print("(the runs' logs removed; --keep keeps them)")


if __name__ == "__main__":
    main()
