"""PcframeCheckpoint in a Lightning fit of several processes (issue 42): real rank processes
with real gloo process groups (``strategy="ddp"`` and ModelParallelStrategy / FSDP2 on CPU),
real SIGKILLs of one rank and of every rank, restarts of the whole job as torchrun restarts
it, and resumes by another number of processes.

The ranks are forked by ``train_child_lightning_ddp.py serve``, which imports Lightning
once (each job then starts in about a second). Kills land at a step the test chooses: a rank
given ``--hold-at N`` writes ``held-r<rank>`` before its batch N+1 and waits there, and the
test kills it once the global version it expects is on disk (no timing guesses); a kill
inside a save is pcframe's own crash point (``PCFRAME_CRASH_AT``), a SIGKILL the rank sends
itself at a named moment of the commit.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from pcframe.distributed.global_versions import valid_records
from pcframe.errors import ConfigError
from pcframe.format.manifest import MANIFEST_NAME, read_manifest
from pcframe.integrations.lightning import PcframeCheckpoint
from tests.distributed.launch import base_env, free_port
from tests.helpers import flip_byte
from tests.integrations.killing import tree_differences

CHILD = Path(__file__).with_name("train_child_lightning_ddp.py")
REPO = Path(__file__).resolve().parents[2]
STEPS = 20  # 4 batches an epoch on every rank: step 20 ends epoch 4, step 6 is mid-epoch
WAIT = 120.0  # seconds a job may take on a busy machine before the test gives up


class Job:
    """One job's ranks, forked by the launcher: kill some, wait for all."""

    def __init__(self, launcher: Launcher, pids: list[int], logdir: Path) -> None:
        self.launcher, self.pids, self.logdir = launcher, pids, logdir
        self.codes: list[int] | None = None

    def logs(self) -> list[str]:
        return [(self.logdir / f"rank{r}.log").read_text() for r in range(len(self.pids))]

    def kill(self, ranks: list[int]) -> None:
        for rank in ranks:  # only ranks still running: a rank that ended is reaped at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pids[rank], signal.SIGKILL)

    def wait(self) -> list[int]:
        if self.codes is None:
            try:
                self.codes = self.launcher.answer()["codes"]
            except queue.Empty:
                self.kill(list(range(len(self.pids))))
                self.codes = self.launcher.answer()["codes"]
                raise AssertionError(
                    f"the job did not end in {WAIT:.0f} s:\n{self.tail()}"
                ) from None
        return self.codes

    def finish(self) -> list[str]:
        """Wait; every rank must have succeeded. Returns the ranks' logs."""
        codes = self.wait()
        assert codes == [0] * len(codes), f"ranks ended with {codes}:\n{self.tail()}"
        return self.logs()

    def stop(self) -> None:
        """Kill whatever is left of the job and collect it (after a failed test)."""
        if self.codes is None:
            if not self.ended():
                self.kill(list(range(len(self.pids))))
            self.codes = self.launcher.answer()["codes"]

    def ended(self) -> bool:
        return self.codes is not None or not self.launcher.answers.empty()

    def tail(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{log[-2500:]}" for r, log in enumerate(self.logs()))


class Launcher:
    """The warm launcher process (``train_child_lightning_ddp.py serve``), one job at a time."""

    def __init__(self) -> None:
        self.env = base_env()
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
            cwd=REPO,
        )
        self.answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self.job: Job | None = None  # the last job started
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.answers.put(json.loads(line))

    def answer(self, timeout: float = WAIT) -> dict[str, Any]:
        return self.answers.get(timeout=timeout)

    def start(
        self,
        world: int,
        directory: Path,
        steps: int,
        out: Path,
        *extra: str,
        rank_env: dict[int, dict[str, str]] | None = None,
        kill_on_failure: bool = True,
    ) -> Job:
        """``kill_on_failure``: as torchrun, one rank's failure SIGKILLs the others at once;
        False lets each rank end by itself (a test that every rank raises, none hangs: with
        the kill, a rank still raising on a busy machine was killed and read as -9)."""
        logdir = out / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        job = {
            "world": world,
            "args": [str(directory), str(steps), "--out", str(out), *extra],
            "logdir": str(logdir),
            "port": free_port(),
            "env": self.env,
            "rank_env": {str(r): e for r, e in (rank_env or {}).items()},
            "kill_on_failure": kill_on_failure,
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        if self.job is not None:
            self.job.stop()  # a test that failed before its job ended
        self.job = Job(self, self.answer(timeout=300)["pids"], logdir)  # the first: imports
        return self.job

    def run(
        self,
        world: int,
        directory: Path,
        steps: int,
        out: Path,
        *extra: str,
        kill_on_failure: bool = True,
    ) -> Job:
        job = self.start(world, directory, steps, out, *extra, kill_on_failure=kill_on_failure)
        job.wait()
        return job

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.job is not None:
            self.job.stop()
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def launcher() -> Iterator[Launcher]:
    started = Launcher()
    yield started
    started.close()


@pytest.fixture(scope="module")
def reference(launcher: Launcher, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-process fit to STEPS (saves every 3 steps and the last)."""
    base = tmp_path_factory.mktemp("reference")
    launcher.run(2, base / "ckpt", STEPS, base).finish()
    return base


def until(condition: Callable[[], bool], job: Job, what: str) -> None:
    """Poll for a condition the job makes true (a marker file, a global version); if it
    does not come, the job's ranks are killed (a held rank would wait for ever)."""
    deadline = time.monotonic() + WAIT
    try:
        while not condition():
            assert not job.ended(), f"the job ended before {what}:\n{job.tail()}"
            assert time.monotonic() < deadline, f"no {what} in {WAIT:.0f} s:\n{job.tail()}"
            time.sleep(0.02)
    except BaseException:
        job.stop()
        raise


def global_steps(root: Path) -> list[int]:
    return [record.step for record in valid_records(root)[0]]


def state(out: Path, name: str) -> dict[str, Any]:
    return torch.load(out / name, weights_only=False)


def assert_same_state(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        assert not tree_differences(a[key], b[key]), f"{key} differs: {a[key]!r:.200}"


EXACT = ("model", "optimizer", "scheduler", "global_step", "rng", "data")


def warnings_of(log: str, text: str) -> list[str]:
    return [
        line for line in log.splitlines() if line.startswith("PcframeCheckpoint:") and text in line
    ]


def said(out: Path, rank: int) -> str:
    """The callback's lines on Lightning's logger, each after its level."""
    return (out / f"said-r{rank}.log").read_text()


def last_line(log: str) -> str:
    return log.strip().splitlines()[-1]


# --- SIGKILL and restart: the resumed job ends bit-identical to the uninterrupted one ---------


@pytest.mark.slow
def test_sigkill_of_one_rank_resumes_every_rank_exactly(launcher, reference, tmp_path):
    root = tmp_path / "ckpt"
    # Rank 1 holds before batch 11 (steps 3, 6, 9 saved); it is killed once step 9 is global.
    job = launcher.start(2, root, STEPS, tmp_path, "--hold-at", "10", "--hold-ranks", "1")
    until(lambda: (tmp_path / "held-r1").exists() and 9 in global_steps(root), job, "step 9")
    job.kill([1])
    assert job.wait() == [-signal.SIGKILL, -signal.SIGKILL]  # the launcher killed rank 0
    assert not (tmp_path / "final-r0.pt").exists()

    logs = launcher.run(2, root, STEPS, tmp_path).finish()
    for rank in range(2):
        resumed = state(tmp_path, f"final-r{rank}.pt")
        assert resumed["resumed_step"] == 9
        assert_same_state(resumed, state(reference, f"final-r{rank}.pt"), EXACT)
    # The resume is one WARNING line on Lightning's logger (shown by its console handler,
    # which a default setup has), from rank 0 only.
    line = f"PcframeCheckpoint: resumed from {root} at step 9 (version 3)"
    assert len(warnings_of(logs[0], line)) == 1
    assert f"WARNING {line}" in said(tmp_path, 0)
    assert not warnings_of(logs[1], "resumed") and "resumed" not in said(tmp_path, 1)


def test_sigkill_of_one_rank_in_the_middle_of_a_save(launcher, reference, tmp_path):
    """Rank 1 is SIGKILLed inside the commit of its shard of step 9 (data written and synced,
    no manifest yet: pcframe's crash point), as rank 0 trains on: version 3 never becomes
    global, and the restarted job resumes from the newest global version (step 6, or step 3
    if a busy machine had not yet published step 6 when rank 1 died), exactly."""
    root = tmp_path / "ckpt"
    crash = {1: {"PCFRAME_CRASH_AT": "data_synced:3"}}
    job = launcher.start(2, root, STEPS, tmp_path, rank_env=crash)
    assert job.wait() == [-signal.SIGKILL, -signal.SIGKILL]
    assert not (tmp_path / "final-r0.pt").exists()
    published = global_steps(root)
    assert 9 not in published and set(published) <= {3, 6}, published
    launcher.run(2, root, STEPS, tmp_path).finish()
    for rank in range(2):
        resumed = state(tmp_path, f"final-r{rank}.pt")
        assert resumed["resumed_step"] == max(published, default=None)
        assert_same_state(resumed, state(reference, f"final-r{rank}.pt"), EXACT)


def test_sigkill_of_every_rank_and_a_damaged_newest_version_fall_back(
    launcher, reference, tmp_path
):
    root = tmp_path / "ckpt"
    job = launcher.start(2, root, STEPS, tmp_path, "--hold-at", "10", "--hold-ranks", "0", "1")
    held = lambda: all((tmp_path / f"held-r{r}").exists() for r in range(2))  # noqa: E731
    until(lambda: held() and 9 in global_steps(root), job, "step 9")
    job.kill([0, 1])
    assert job.wait() == [-signal.SIGKILL, -signal.SIGKILL]
    # Rank 1's shard of the newest global version (step 9, version 3) is damaged on disk.
    flip_byte(root / "rank-1" / "v00000003" / "data.bin", 100)

    logs = launcher.run(2, root, STEPS, tmp_path).finish()
    fallback = warnings_of(logs[0], "version 3 in")
    assert len(fallback) == 1 and "falling back to an older version" in fallback[0], logs[0]
    assert f"WARNING {fallback[0]}" in said(tmp_path, 0)
    assert len(warnings_of(logs[0], f"resumed from {root} at step 6 (version 2)")) == 1
    for rank in range(2):
        resumed = state(tmp_path, f"final-r{rank}.pt")
        assert resumed["resumed_step"] == 6
        assert_same_state(resumed, state(reference, f"final-r{rank}.pt"), EXACT)


def test_fsdp2_model_parallel_resumes_exactly_after_a_sigkill(launcher, tmp_path):
    """ModelParallelStrategy with fully_shard (FSDP2) runs on CPU with gloo: sharded
    DTensor weights and optimizer moments, each rank writing its own shards."""
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    launcher.run(2, reference / "ckpt", 12, reference, "--fsdp").finish()
    job = launcher.start(
        2, killed / "ckpt", 12, killed, "--fsdp", "--hold-at", "7", "--hold-ranks", "0"
    )
    until(
        lambda: (killed / "held-r0").exists() and 6 in global_steps(killed / "ckpt"), job, "step 6"
    )
    job.kill([0])
    assert job.wait() == [-signal.SIGKILL, -signal.SIGKILL]
    launcher.run(2, killed / "ckpt", 12, killed, "--fsdp").finish()
    for rank in range(2):
        resumed = state(killed, f"final-r{rank}.pt")
        assert resumed["resumed_step"] == 6
        assert_same_state(resumed, state(reference, f"final-r{rank}.pt"), EXACT)
    # Sharded, not replicated: each rank wrote half of the first layer's 16 x 8 weight.
    for rank in range(2):
        newest = max((killed / "ckpt" / f"rank-{rank}").glob("v*"))
        entries = read_manifest(newest / MANIFEST_NAME).entries
        assert {e.name: e.shape for e in entries}["model/net.0.weight/data"] == (8, 8)
    # One process without FSDP resumes the sharded version (step 12 ends epoch 3): whole
    # tensors, assembled from both ranks' shards.
    alone = tmp_path / "alone"
    launcher.run(1, killed / "ckpt", 14, alone).finish()
    start = state(alone, "start-r0.pt")
    assert start["resumed_step"] == 12
    assert_same_state(start, state(reference, "final-r0.pt"), ("model", "optimizer", "scheduler"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp2_on_one_gpu_resumes_exactly_after_a_sigkill(launcher, tmp_path):
    """The GPU twin of the FSDP2 test: ModelParallelStrategy on one CUDA device (its
    DTensor parameters take the multi-process path), CUDA RNG and NCCL included."""
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    launcher.run(1, reference / "ckpt", 12, reference, "--fsdp", "--cuda").finish()
    job = launcher.start(
        1, killed / "ckpt", 12, killed, "--fsdp", "--cuda", "--hold-at", "7", "--hold-ranks", "0"
    )
    until(lambda: (killed / "held-r0").exists() and 6 in global_steps(killed / "ckpt"), job, "6")
    job.kill([0])
    assert job.wait() == [-signal.SIGKILL]
    launcher.run(1, killed / "ckpt", 12, killed, "--fsdp", "--cuda").finish()
    resumed = state(killed, "final-r0.pt")
    assert resumed["resumed_step"] == 6
    assert_same_state(resumed, state(reference, "final-r0.pt"), (*EXACT, "cuda_rng"))


# --- another number of processes ---------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 3])
def test_another_number_of_processes_resumes_an_end_of_epoch_version(
    launcher, reference, tmp_path, world
):
    root = tmp_path / "ckpt"
    shutil.copytree(reference / "ckpt", root)
    job = launcher.run(world, root, STEPS + 4, tmp_path)
    logs = job.finish()
    saved = state(reference, "final-r0.pt")
    for rank in range(world):
        start = state(tmp_path, f"start-r{rank}.pt")
        assert start["resumed_step"] == STEPS and start["global_step"] == STEPS
        # DDP's replicated weights and moments: every rank of the new job has them all.
        assert_same_state(start, saved, ("model", "optimizer", "scheduler"))
        assert state(tmp_path, f"final-r{rank}.pt")["global_step"] == STEPS + 4
    where = f"version 7, saved by 2 processes, resharded to {world}"
    line = f"resumed from {root} at step {STEPS} ({where})"
    assert len(warnings_of(logs[0], line)) == 1, logs[0]


def test_a_mid_epoch_version_into_another_number_of_processes_is_one_line(launcher, tmp_path):
    root = tmp_path / "ckpt"
    launcher.run(2, root, 6, tmp_path / "first").finish()  # step 6: batch 2 of epoch 1
    job = launcher.run(3, root, 12, tmp_path / "second", kill_on_failure=False)
    assert job.wait() == [1, 1, 1]  # every rank stops, none hangs in a collective
    for log in job.logs():
        assert "saved mid-epoch (batch 2 of its epoch) by 2 processes and this fit runs 3" in (
            last_line(log)
        ), log[-2000:]
    assert global_steps(root) == [6, 3]  # nothing written over


def test_a_one_process_folder_in_a_fit_of_two_is_one_line(launcher, tmp_path):
    root = tmp_path / "ckpt"
    launcher.run(1, root, 3, tmp_path / "first").finish()
    job = launcher.run(2, root, 6, tmp_path / "second", kill_on_failure=False)
    assert job.wait() == [1, 1]
    for log in job.logs():
        assert last_line(log) == (
            f"ValueError: PcframeCheckpoint: {root} holds checkpoints of a one-process fit "
            "(versions 1..1) and this fit runs 2 processes: give it its own dirpath, or resume "
            "that one with devices=1"
        )


def test_a_one_process_folder_on_one_rank_only_stops_every_rank_in_one_line(launcher, tmp_path):
    """Each rank its own folder, rank 0's holding a one-process fit: rank 0 refused before
    the ranks agreed on anything, and rank 1 died on a raw torch network error."""
    folders = str(tmp_path / "ckpt-{rank}")
    launcher.run(1, folders, 3, tmp_path / "first").finish()
    job = launcher.run(2, folders, 6, tmp_path / "second", kill_on_failure=False)
    assert job.wait() == [1, 1]
    first, second = job.logs()
    assert "holds checkpoints of a one-process fit" in last_line(first), first[-2000:]
    assert last_line(second).startswith(
        "pcframe.errors.CheckpointError: PcframeCheckpoint: rank 0 refused the resume"
    ), second[-2000:]


def test_another_models_folder_is_a_short_line_naming_it_and_the_fix(launcher, reference, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(reference / "ckpt", root)
    job = launcher.run(2, root, STEPS + 2, tmp_path, "--hidden", "32", kill_on_failure=False)
    assert job.wait() == [1, 1]
    for log in job.logs():
        line = last_line(log)
        assert line.startswith(
            f"pcframe.errors.StateMismatch: PcframeCheckpoint: {root} holds "
            "checkpoints of another model"
        ), line
        assert "give this run its own dirpath, or pass resume=False" in line
        assert len(line.replace(str(root), "DIR")) < 300, line  # short, but for the folder


def test_another_precision_is_a_short_line_naming_it_and_the_fix(launcher, reference, tmp_path):
    """The multi-rank restore's refusal of a dtype listed every mismatch on lines of their
    own, ending "restore(allow_cast=True) casts tensors to the live dtypes", which no
    Lightning user can call."""
    root = tmp_path / "ckpt"
    shutil.copytree(reference / "ckpt", root)
    extra = ("--precision", "64-true")
    job = launcher.run(2, root, STEPS + 2, tmp_path, *extra, kill_on_failure=False)
    assert job.wait() == [1, 1]
    for log in job.logs():
        line = last_line(log)
        assert line.startswith(
            f"pcframe.errors.StateMismatch: PcframeCheckpoint: {root} holds checkpoints of a "
            "model in torch.float32, and this run's is in torch.float64 (model['net.0.weight']: "
        ), log[-2000:]
        assert line.endswith(
            "train in the precision it was saved with (the model in torch.float32), give this "
            f"run its own dirpath, or pass resume=False to start over in {root}"
        ), line
        assert "allow_cast" not in log and "strict=False" not in log, log[-2000:]


# --- options, refused or taken when the callback is made --------------------------------------


def test_unknown_options_are_refused_with_a_near_match(tmp_path):
    with pytest.raises(
        TypeError,
        match=r"unknown option every_n_train_step=3 \(did you mean every_n_train_steps=\?\)",
    ):
        PcframeCheckpoint(tmp_path, every_n_train_step=3)
    with pytest.raises(TypeError, match=r"keep_lst=.*did you mean keep_last="):
        PcframeCheckpoint(tmp_path, keep_lst=2)
    with pytest.raises(ValueError, match="filename= has no meaning here"):
        PcframeCheckpoint(tmp_path, filename="{epoch}")
    with pytest.raises(ValueError, match="mutually exclusive"):
        PcframeCheckpoint(tmp_path, every_n_epochs=1, every_n_train_steps=5)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        # each was taken, then failed at fit start (a raw TypeError, gloo's "Invalid
        # timeout", an AttributeError) or, keep_global=2.5, stopped the commit protocol
        ({"keep_global": 2.5}, "keep_global=2.5: keep at least 2 global versions"),
        ({"keep_global": "x"}, "keep_global='x'"),
        ({"protocol_timeout": -5}, "protocol_timeout=-5: give the seconds"),
        ({"protocol_timeout": "30"}, "protocol_timeout='30'"),
        ({"replicas": -1}, "replicas=-1: give 0"),
        ({"notices": "SIGTERM"}, "notices='SIGTERM': give notice sources"),
        ({"tiers": 5}, "tiers=5: give {name: tier}"),
        ({"placement": "x"}, "placement='x': give a placement policy"),
        ({"verbose": "x"}, "verbose='x': use True or False"),
    ],
)
def test_bad_values_of_the_engines_options_are_refused_when_made(tmp_path, options, words):
    with pytest.raises(ConfigError) as info:
        PcframeCheckpoint(tmp_path, **options)
    assert str(info.value).startswith("PcframeCheckpoint: ") and words in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_lightning_spellings_are_taken(tmp_path):
    assert PcframeCheckpoint(dirpath=tmp_path, every_n_epochs=2, save_last=True).policy.every == 2
    timed = PcframeCheckpoint(tmp_path, train_time_interval=datetime.timedelta(minutes=5))
    assert timed.policy.seconds == 300
    assert PcframeCheckpoint(tmp_path, save_last="link").save_last is True
    # Engine options of the multi-process engine are taken too (ignored in one process).
    assert PcframeCheckpoint(tmp_path, keep_global=3, protocol_timeout=60).engine_options == {
        "keep_global": 3,
        "protocol_timeout": 60,
    }
