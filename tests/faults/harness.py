"""Shared harness of the crash matrix and the fault campaign: modes, the saver, the checks.

A *mode* is one way of configuring the engine (raw, codecs, deltas, the mmap persist path, a
local or a remote replica tier, two ranks). Run as a module, this file is the child process
that saves in a loop until it kills itself at a crash point::

    python -m tests.faults.harness save CONFIG_JSON      # one process (or one rank)
    python -m tests.faults.harness resume CONFIG_JSON    # a rank of a fresh 2-rank job

The saver uses :class:`tests.stamp.StepStampOptimizer`: after ``optimizer.step()``
every parameter (and, with ``moments``, every ``exp_avg``) holds the step number, so a
version mixing two steps is caught by :func:`check_version`. Each version the child learns is
committed is printed as ``committed <version> <step>``; a crash must never lose one of them.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.warm import WarmProcess

REPO = Path(__file__).resolve().parents[2]

# Crash points every single-process mode passes (the engine's save and commit path).
BASE_POINTS = (
    "chunk_written",
    "data_synced",
    "manifest_written",
    "published",
    "latest_written",
    "retention",
    "trash_renamed",
)

# The n-th pass at which a point fires by default: late enough that earlier versions are
# committed (and retention has something to delete), early enough to crash in a second.
DEFAULT_NTH = {
    "chunk_written": 20,
    "segment_written": 12,
    "data_synced": 3,
    "manifest_written": 3,
    "published": 3,
    "latest_written": 3,
    "retention": 2,
    "trash_renamed": 2,
    "replica_copied": 3,
    "remote_file_uploaded": 4,
    "remote_marker_deleted": 1,
    "global_record_written": 3,
    "global_published": 3,
}

ENGINE = {"chunk_bytes": 8192, "max_in_flight": 2, "writer_threads": 2, "keep_last": 2}


@dataclass(frozen=True)
class Mode:
    name: str
    engine: dict[str, Any] = field(default_factory=dict)
    moments: bool = False  # stamp an exp_avg state tensor too (the Adam moment stand-in)
    tier: str | None = None  # None, "local" or "remote"
    ranks: int = 1
    extra_points: tuple[str, ...] = ()
    fast_points: tuple[str, ...] = ()  # what the default (non-slow) suite runs

    @property
    def points(self) -> tuple[str, ...]:
        return BASE_POINTS + self.extra_points

    def options(self) -> dict[str, Any]:
        return {**ENGINE, **self.engine}


MODES: dict[str, Mode] = {
    m.name: m
    for m in [
        Mode("raw", fast_points=BASE_POINTS),
        Mode(
            "zstd",
            {"codecs": {"model/*": "zstd", "optimizer/state/*/exp_avg": "zstd"}},
            moments=True,
            extra_points=("segment_written",),
            fast_points=("segment_written",),
        ),
        Mode(
            "int8",
            {"codecs": {"optimizer/state/*/exp_avg": "int8_block"}},
            moments=True,
            extra_points=("segment_written",),
            fast_points=("segment_written",),
        ),
        Mode(
            "delta",
            {"codecs": {"model/*": "xor_delta_zstd"}, "keep_last": 1, "full_every": 3},
            extra_points=("segment_written",),
            fast_points=("segment_written", "trash_renamed"),
        ),
        Mode("mmap", {"persist": "mmap"}, fast_points=("chunk_written",)),
        Mode(
            "local",
            tier="local",
            extra_points=("replica_copied",),
            fast_points=("replica_copied",),
        ),
        Mode(
            "remote",
            tier="remote",
            extra_points=("remote_file_uploaded", "remote_marker_deleted"),
            fast_points=("remote_file_uploaded", "remote_marker_deleted"),
        ),
        Mode(
            "dist",
            ranks=2,
            extra_points=("global_record_written", "global_published"),
            fast_points=("global_record_written",),
        ),
    ]
}

# Distributed crash points are rank 0's (the coordinator); engine points fire on rank 1.
COORDINATOR_POINTS = ("global_record_written", "global_published")


def crash_rank(point: str) -> int:
    return 0 if point in COORDINATOR_POINTS else 1


# --- an I/O fault injector (installed in a child process) -------------------------------------

_ERRNOS = {"EIO": errno.EIO, "EINTR": errno.EINTR, "ENOSPC": errno.ENOSPC, "EMFILE": errno.EMFILE}


class Injector:
    """Monkeypatches ``os.<fn>`` so that calls on files under ``root`` fail or come up short.

    ``after`` matching calls pass first; then ``times`` calls fail (``-1``: every call) with
    ``err`` (an errno name) or, for ``err="short"``, transfer only part of what was asked.
    """

    def __init__(self, fn: str, err: str, after: int, times: int, root: str) -> None:
        self.fn, self.err, self.after, self.times = fn, err, after, times
        self.root = os.path.realpath(root)
        self.armed = False
        self.seen = self.fired = 0
        self.original = getattr(os, fn)
        setattr(os, fn, self._wrapper)

    def arm(self) -> None:
        """Start counting afresh: each armed phase (CLI, restore, saves) gets the fault."""
        self.armed, self.seen, self.fired = True, 0, 0

    def disarm(self) -> None:
        self.armed = False

    def _path(self, args: tuple) -> str:
        if self.fn == "open":
            return os.path.realpath(os.fsdecode(args[0]))
        try:
            return os.readlink(f"/proc/self/fd/{args[0]}")
        except OSError:
            return ""

    def _wrapper(self, *args: Any, **kwargs: Any) -> Any:
        if not self.armed or not self._path(args).startswith(self.root):
            return self.original(*args, **kwargs)
        self.seen += 1
        if self.seen <= self.after or (0 <= self.times <= self.fired):
            return self.original(*args, **kwargs)
        self.fired += 1
        if self.err != "short":
            code = _ERRNOS[self.err]
            raise OSError(code, os.strerror(code), self._path(args))
        if self.fn == "preadv":
            fd, buffers, offset = args[0], args[1], args[2]
            first = memoryview(buffers[0]).cast("B")
            return self.original(fd, [first[: max(1, len(first) // 2)]], offset)
        if self.fn == "pread":
            fd, n, offset = args
            return self.original(fd, max(1, n // 2), offset)
        if self.fn == "pwrite":
            fd, data, offset = args
            data = memoryview(data).cast("B")
            return self.original(fd, data[: max(1, len(data) // 2)], offset)
        return self.original(*args, **kwargs)


# --- the child ------------------------------------------------------------------------------


def build(moments: bool):
    import torch

    from tests.stamp import StepStampOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    return model, StepStampOptimizer(model.parameters(), moments=moments)


def make_checkpointer(config: dict[str, Any], model, optimizer):
    """A Checkpointer of ``config``'s mode on ``config["root"]`` (tiers included)."""
    from pcframe import Checkpointer

    mode = MODES[config["mode"]]
    kwargs: dict[str, Any] = {}
    if mode.tier is not None:
        import pcframe.policies as P
        from pcframe.store.tiers import RemoteTier, Tiers

        if mode.tier == "local":
            tier: Any = config["replica"]
        else:
            tier = RemoteTier(config["remote_url"], config["storage_options"], timeout=10)
        kwargs["tiers"] = Tiers({"replica": tier}, backoff=0.05, backoff_max=0.2)
        kwargs["placement"] = P.LocalPlusRemote(
            local_tier="primary", remote_tier="replica", remote_every=1, local_keep=2,
            remote_keep=2,
        )  # fmt: skip
    return Checkpointer(
        config["root"], model=model, optimizer=optimizer, **kwargs, **mode.options()
    )


def _single_saver(config: dict[str, Any]) -> None:
    model, opt = build(MODES[config["mode"]].moments)
    tiered = MODES[config["mode"]].tier is not None
    with make_checkpointer(config, model, opt) as ckpt:
        step = ckpt.restore() or 0
        opt.count = step
        _say("ready", step)
        pending = []
        for _ in range(config.get("limit", 400)):
            step += 1
            opt.step()  # gated on the in-flight snapshot copies
            pending.append(ckpt.save(step))
            if tiered:  # every version reaches the replica (uploads, then tier retention)
                pending[-1].wait()
                ckpt.tiers.wait_idle(30)
            pending = _report(pending)
        ckpt.wait()
        _report(pending)
    _limit_reached(config)


def _limit_reached(config: dict[str, Any]) -> None:
    """``limit`` steps saved: exit 3 (a crash point that never fired), or ``exit_code``."""
    code = config.get("exit_code", 3)
    if code:
        _say("limit reached without crashing")
    sys.exit(code)


def _say(*parts: object) -> None:
    """One line to the parent in one ``write``: a crash point firing in a background thread
    while ``print`` is between its pieces left ``committed `` cut short (CI, stop 29)."""
    os.write(sys.stdout.fileno(), (" ".join(map(str, parts)) + "\n").encode())


def _report(pending: list) -> list:
    left = []
    for handle in pending:
        if not handle.done():
            left.append(handle)
        elif handle.status == "committed":
            _say("committed", handle.version, handle.step)
    return left


def _init_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    return dist


def _dist_checkpointer(config: dict[str, Any], model, opt):
    from pcframe.distributed import DistributedCheckpointer

    return DistributedCheckpointer(
        config["root"], model=model, optimizer=opt, protocol_timeout=60,
        **MODES[config["mode"]].options(),
    )  # fmt: skip


def _dist_saver(config: dict[str, Any]) -> None:
    dist = _init_rank()
    model, opt = build(MODES[config["mode"]].moments)
    ckpt = _dist_checkpointer(config, model, opt)
    step = ckpt.restore() or 0
    opt.count = step
    _say("ready", step)
    pending = []
    for _ in range(config.get("limit", 200)):
        step += 1
        opt.step()
        pending.append(ckpt.save(step))
        pending = _report(pending)
    ckpt.close()
    dist.destroy_process_group()
    _limit_reached(config)


def _dist_resume(config: dict[str, Any]) -> None:
    """A fresh 2-rank job: restore, check the stamps, commit one more global version."""
    dist = _init_rank()
    model, opt = build(MODES[config["mode"]].moments)
    ckpt = _dist_checkpointer(config, model, opt)
    spec, injector = config.get("io"), None
    if spec and int(os.environ["RANK"]) == spec.get("rank", 1):
        injector = Injector(spec["fn"], spec["err"], spec["after"], spec["times"], config["root"])
        injector.arm()
    try:
        step = ckpt.restore()
    except Exception as exc:  # reported, then this rank leaves (the others too)
        _say("result", json.dumps({"error": f"{type(exc).__name__}: {exc}"[:600]}))
        raise
    finally:
        if injector:
            injector.disarm()
    skipped = [list(s) for s in ckpt.last_restore.skipped] if ckpt.last_restore else []
    restored = step or 0
    stamped = all(bool((p == float(restored)).all()) for p in model.parameters()) if step else True
    version = ckpt.last_restore.version if ckpt.last_restore else None
    opt.count = restored
    opt.step()
    status = ckpt.save(restored + 1).wait()
    ckpt.close()
    dist.destroy_process_group()
    _say(
        "result",
        json.dumps(
            {
                "step": step,
                "version": version,
                "stamped": stamped,
                "status": str(status),
                "skipped": skipped,
                "fired": injector.fired if injector else None,
            }
        ),
    )


def main(argv: list[str]) -> None:
    command, config = argv[0], json.loads(argv[1])
    if command == "save":
        (_dist_saver if MODES[config["mode"]].ranks > 1 else _single_saver)(config)
    elif command == "resume":
        _dist_resume(config)
    else:
        raise SystemExit(f"unknown command {command!r}")


# --- running children -----------------------------------------------------------------------


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PCFRAME_CRASH_AT", None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


@dataclass
class ChildResult:
    returncodes: list[int]  # per rank; a rank killed by the launcher reads -9 too
    outputs: list[str]
    timed_out: bool = False

    @property
    def committed(self) -> dict[int, int]:
        """Versions each child was told are committed: version -> step (all ranks)."""
        found: dict[int, int] = {}
        for text in self.outputs:
            for line in text.split("\n")[:-1]:  # whole lines only
                if line.startswith("committed "):
                    _, version, step = line.split()
                    found[int(version)] = int(step)
        return found

    def tail(self, n: int = 3000) -> str:
        return "\n".join(f"--- rank {r} rc {rc} ---\n{o[-n:]}" for r, (rc, o) in
                         enumerate(zip(self.returncodes, self.outputs, strict=True)))  # fmt: skip

    def result(self, rank: int = 0) -> dict[str, Any]:
        for line in self.outputs[rank].splitlines():
            if line.startswith("result "):
                return json.loads(line[len("result ") :])
        raise AssertionError(f"rank {rank} printed no result:\n{self.tail()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_children(
    command: str,
    config: dict[str, Any],
    crash_at: str | None = None,
    rank: int = 0,
    timeout: float = 90.0,
    logdir: Path | None = None,
    kill_others: bool = True,
    started: list | None = None,
) -> ChildResult:
    """Run the saver (or the 2-rank resume) of ``config``; arm ``crash_at`` on ``rank``.

    Like torchrun, when one rank dies the others are SIGKILLed (unless ``kill_others`` is
    false: then the survivors must exit by themselves). A job still running after
    ``timeout`` seconds is SIGKILLed and reported as ``timed_out``. The processes are
    appended to ``started`` (if given) as they start, each the leader of its own session.
    """
    ranks = MODES[config["mode"]].ranks
    base = child_env()
    if ranks > 1:
        base.update(WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    logdir = logdir or Path(config["root"]).parent / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for r in range(ranks):
        env = dict(base)
        if ranks > 1:
            env.update(RANK=str(r), LOCAL_RANK=str(r))
        if crash_at and r == rank:
            env["PCFRAME_CRASH_AT"] = crash_at
        log = open(logdir / f"{command}-r{r}.log", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            WarmProcess(
                "tests.faults.harness",
                [command, json.dumps(config)],
                env=env,
                cwd=REPO,
                log=log.name,
                new_session=True,
            )
        )
        if started is not None:
            started.append(procs[-1])
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while None in [p.poll() for p in procs]:  # poll every rank (no short circuit)
            failed = kill_others and any(p.returncode not in (None, 0) for p in procs)
            if time.monotonic() > deadline:
                timed_out = True
            if failed or timed_out:
                time.sleep(0 if timed_out else 0.2)
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGKILL)
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return ChildResult([p.returncode for p in procs], outputs, timed_out)


# --- checks -----------------------------------------------------------------------------------


def check_version(loaded) -> int:
    """Every stamped tensor of a loaded version holds its manifest's step; return the step."""
    import torch

    step = loaded.manifest.step
    for entry, tensor in zip(loaded.manifest.entries, loaded.tensors, strict=True):
        stamped = entry.name.startswith("model/") or entry.name.endswith("/exp_avg")
        if not stamped or not tensor.is_floating_point() or not tensor.numel():
            continue
        want = torch.full_like(tensor, float(step))
        if entry.codec == "int8_block":  # lossy: within the codec's error bound
            ok = torch.allclose(tensor, want, rtol=1e-2, atol=0)
        else:
            ok = torch.equal(tensor, want)
        values = sorted({float(v) for v in tensor.flatten()[:64]})[:4]
        assert ok, f"v{loaded.manifest.version} (step {step}) mixes steps: {entry.name} {values}"
    return step


def check_directory(
    root: Path, told: dict[int, int], previous_latest: int = 0, strict_latest: bool = True
) -> dict[int, int]:
    """A local checkpoint directory after a crash: returns {version: step} of what it holds.

    Every committed version verifies (with its delta chain) and holds one step; LATEST names
    a committed version and is not behind a version the writer was told is committed; no
    such version was lost (it is still listed, or retention legitimately deleted it because
    a newer one is committed). ``strict_latest=False`` (after injected I/O errors, which may
    legitimately leave LATEST lagging) checks only that LATEST is not ahead of the listing.
    """
    from pcframe.restore.reader import load_version
    from pcframe.store.directory import CheckpointDir

    directory = CheckpointDir(root)
    versions = directory.committed_versions()
    steps = {v: check_version(load_version(directory.path(v))) for v in versions}
    latest = directory.latest_hint()
    if latest is not None and not strict_latest:
        assert latest <= max(versions, default=0), f"{root}: LATEST v{latest} ahead of {versions}"
    elif latest is not None:
        assert latest in versions, f"{root}: LATEST names v{latest}, committed: {versions}"
        assert latest >= previous_latest, f"{root}: LATEST went back {previous_latest}->{latest}"
    newest_told = max(told, default=0)
    if newest_told and not strict_latest:
        assert versions and max(versions) >= newest_told, (
            f"{root}: v{newest_told} was reported committed but the newest is {versions}"
        )
    elif newest_told:
        assert versions and max(versions) >= newest_told, (
            f"{root}: v{newest_told} was reported committed but the newest is {versions}"
        )
        assert latest is not None and latest >= newest_told, (
            f"{root}: LATEST {latest} is behind v{newest_told}, reported committed"
        )
    for version, step in told.items():
        if version in steps:
            assert steps[version] == step, f"v{version}: step {steps[version]}, told {step}"
    return steps


def remote_versions(url: str, storage_options: dict[str, Any], scratch: Path) -> dict[int, int]:
    """Every version a remote tier lists: fetched, verified, stamped; {version: step}."""
    from pcframe.restore.reader import load_version
    from pcframe.store.tiers import RemoteTier

    tier = RemoteTier(url, storage_options, timeout=10)
    found = {}
    try:
        for version in tier.committed_versions():
            with tier.fetch(version, scratch / f"fetch-{version}") as path:
                found[version] = check_version(load_version(path))
    finally:
        close = getattr(tier, "close", None)
        if close:
            close()
    return found


def check_global(root: Path, told: dict[int, int]) -> dict[int, int]:
    """A 2-rank root after a crash: every record's shards verify; {global version: step}."""
    from pcframe.distributed import global_versions as rec
    from pcframe.format.manifest import MANIFEST_NAME
    from pcframe.format.names import version_name
    from pcframe.restore.reader import load_version

    records, invalid = rec.valid_records(root)
    assert not invalid, f"invalid global records after a crash: {invalid}"
    steps = {}
    for record in records:
        for shard in record.shards:
            directory = root / shard.directory / version_name(shard.version)
            assert rec.manifest_crc(directory / MANIFEST_NAME) == shard.manifest_crc32c
            loaded = load_version(directory)
            assert check_version(loaded) == record.step, f"shard {directory} step differs"
        steps[record.version] = record.step
    pointer = rec.read_pointer(root)
    assert pointer is None or pointer in steps, f"GLOBAL names v{pointer}, records: {steps}"
    newest_told = max(told, default=0)
    assert max(steps, default=0) >= newest_told, f"global v{newest_told} lost: {sorted(steps)}"
    for rank in range(2):  # every locally committed shard verifies too
        if (root / rec.rank_dirname(rank)).is_dir():
            check_directory(root / rec.rank_dirname(rank), {})
    return steps


def leftovers(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".tmp") or ".trash-" in p.name)


def resume_in_process(config: dict[str, Any], expected_step: int | None) -> int:
    """A fresh writer restores ``expected_step`` (stamps checked), commits one more version.

    Returns the new version's number.
    """
    import torch

    from pcframe.format.names import version_name
    from pcframe.restore.reader import load_version
    from pcframe.store.directory import CheckpointDir

    root = Path(config["root"])
    before = CheckpointDir(root)
    top = max([*before.committed_versions(), before.latest_hint() or 0], default=0)
    model, opt = build(MODES[config["mode"]].moments)
    with make_checkpointer(config, model, opt) as ckpt:
        assert not leftovers(root), f"a fresh writer left {leftovers(root)}"
        step = ckpt.restore()
        assert step == expected_step, f"resumed at step {step}, newest committed {expected_step}"
        if step is not None:
            for name, p in model.named_parameters():
                assert torch.equal(p, torch.full_like(p, float(step))), f"{name} not step {step}"
        opt.count = step or 0
        opt.step()
        handle = ckpt.save(opt.count)
        assert handle.wait(60) == "committed"
        if MODES[config["mode"]].tier is not None:
            assert ckpt.tiers.wait_idle(60)
        version = handle.version
    assert version > top, f"new version {version} reuses a number <= {top}"
    after = CheckpointDir(root)
    assert after.latest_hint() == version
    assert check_version(load_version(root / version_name(version))) == opt.count
    return version


if __name__ == "__main__":
    main(sys.argv[1:])
