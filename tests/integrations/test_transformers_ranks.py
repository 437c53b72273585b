"""PcframeCallback in a ``transformers.Trainer`` job of several processes: real torchrun, real
gloo groups (DDP on CPU), real SIGKILLs, compared bit for bit with an uninterrupted job.

The child is ``train_child_hf_ranks.py``: a tiny GPT-2, 32 samples, 4 a device, so with two
processes an epoch is 4 steps; versions every 3 steps. Faults land at known steps (markers,
no sleeps): rank 1 SIGKILLs itself at step 6 (its save of step 6 just started), torchrun
restarts both ranks, they resume and block after step 13, the test SIGKILLs the launcher
and every rank, damages the newest global version on rank 1, and a new torchrun falls back to
the version before it and finishes the job.

torchrun restarts a gloo job reliably only with a fresh store per attempt
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and the c10d rendezvous; see docs/integrations.md).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pcframe.distributed import global_versions
from pcframe.format.names import version_name
from tests.integrations.killing import tree_differences

pytestmark = pytest.mark.slow  # end to end, several seconds each

pytest.importorskip("transformers")

CHILD = Path(__file__).with_name("train_child_hf_ranks.py")
REPO = Path(__file__).resolve().parents[2]
STEPS = 18  # 4 steps an epoch with two processes: the job ends mid-epoch
RESUMED = "[transformers] PcframeCallback: resumed from"  # as a default Trainer setup shows it


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One thread a rank; the repository off the path (its top-level ``kernels/`` folder would
    shadow Hugging Face's ``kernels`` package, which transformers imports when installed), but
    its ``pcframe`` on it (the editable install may be another checkout's, a worktree's)."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    only = tmp_path_factory.mktemp("pcframe-only")
    (only / "pcframe").symlink_to(REPO / "pcframe", target_is_directory=True)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != REPO]
    env["PYTHONPATH"] = os.pathsep.join([str(only), *kept])
    env.pop("PCFRAME_CRASH_AT", None)
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    env: dict[str, str], out: Path, *args: str, procs: int = 2, restarts: int = 0
) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={procs}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--max-restarts={restarts}",
        str(CHILD),
        str(out),
        *args,
    ]
    log = (out.parent / f"{out.name}.log").open("a")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out.parent)


def finish(proc: subprocess.Popen, out: Path, code: int = 0) -> str:
    proc.wait(timeout=240)
    text = (out.parent / f"{out.name}.log").read_text()
    assert proc.returncode == code, text[-4000:]
    return text


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Path:
    """The uninterrupted two-process job (its losses, final state and versions)."""
    out = tmp_path_factory.mktemp("hf-ranks") / "reference"
    out.mkdir()
    text = finish(launch(env, out, str(STEPS)), out)
    assert RESUMED not in text
    return out


def losses(out: Path, rank: int) -> list[tuple[int, str]]:
    lines = (out / f"losses-rank{rank}.txt").read_text().split()
    return list(zip(map(int, lines[::2]), lines[1::2], strict=True))


def final(out: Path, rank: int) -> dict:
    return torch.load(out / f"final-rank{rank}.pt", weights_only=False)


def wait_for(paths: list[Path], proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 180
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, finish(proc, out, proc.returncode)[-4000:]
        assert time.monotonic() < deadline, f"no {paths} after 180 s"
        time.sleep(0.05)  # polling a marker, not waiting for a step


def gone(pid: int) -> None:
    """Wait until ``pid`` has exited (not our child: no waitpid; a zombie has exited)."""
    deadline = time.monotonic() + 60
    status = Path(f"/proc/{pid}/status")
    while True:
        try:
            if "\nState:\tZ" in status.read_text():
                return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline, f"process {pid} still alive 60 s after SIGKILL"
        time.sleep(0.01)


def assert_same_job(reference: Path, out: Path) -> None:
    """Every loss any start computed, and the final state of each rank, as uninterrupted."""
    for rank in (0, 1):
        expected = dict(losses(reference, rank))
        got = losses(out, rank)
        assert {step for step, _ in got} == set(expected)
        wrong = [(step, loss, expected[step]) for step, loss in got if expected[step] != loss]
        assert not wrong, f"rank {rank}: losses differ (step, resumed, uninterrupted): {wrong}"
        a, b = final(reference, rank), final(out, rank)
        for part in ("model", "optimizer", "scheduler"):
            assert not tree_differences(a[part], b[part]), f"rank {rank}: {part} differs"
        # total_flos lags after a resume (docs/integrations.md, Limits), and the summary
        # train() logs at its end counts this start's steps; the rest is exact.
        state_a, state_b = a["trainer_state"], b["trainer_state"]
        flos_a, flos_b = state_a.pop("total_flos"), state_b.pop("total_flos")
        assert 0 < flos_b <= flos_a
        for state in (state_a, state_b):
            summary = state["log_history"].pop()
            assert "train_runtime" in summary and state["log_history"] == []
        assert not tree_differences(state_a, state_b)


def test_sigkill_of_one_rank_then_of_all_resumes_bit_identical(
    tmp_path: Path, env: dict[str, str], reference: Path
) -> None:
    out = tmp_path / "killed"
    out.mkdir()
    faults = ("--kill-rank", "1", "--kill-at", "6", "--hold-at", "13")
    # Rank 1 dies at step 6; torchrun stops rank 0 and starts both again (restarts=1).
    job = launch(env, out, str(STEPS), *faults, restarts=1)
    held = [out / "held-rank0", out / "held-rank1"]
    wait_for(held, job, out)
    assert (out / "killed-one").read_text() == "6"
    # Then the whole job at step 13: the launcher first (it would restart the ranks), then
    # every rank (torchrun starts them in sessions of their own).
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=60)
    for marker in held:
        pid = int(marker.read_text().split()[1])
        os.kill(pid, signal.SIGKILL)
        gone(pid)  # its directory locks released before the next job opens them
    first = (out.parent / "killed.log").read_text()
    assert first.count(RESUMED) == 1, first[-4000:]  # the restart, said once (rank 0)
    resumed_at = int(first.split(RESUMED)[1].split(" at step ")[1].split()[0])
    assert resumed_at in (3, 6)  # the version of step 6 may not have been global yet
    # The newest global version damaged on rank 1: every rank falls back to the one before.
    records, _ = global_versions.valid_records(out / "ckpt")
    newest, before = records[0], records[1]
    data = out / "ckpt" / global_versions.rank_dirname(1) / version_name(newest.version)
    raw = bytearray((data / "data.bin").read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit: a chunk checksum fails
    (data / "data.bin").write_bytes(bytes(raw))
    text = finish(launch(env, out, str(STEPS), *faults), out)
    second = text[len(first) :]
    assert second.count(RESUMED) == 1, second[-4000:]
    fallback = f"[transformers] PcframeCallback: version {newest.version} in {out / 'ckpt'} is "
    assert second.count(fallback) == 1, second[-4000:]
    assert f" at step {before.step} " in second.split(RESUMED)[1]
    assert_same_job(reference, out)


def test_another_number_of_processes(tmp_path: Path, env: dict[str, str], reference: Path) -> None:
    """Two processes' mid-epoch version into one: with the same batches an epoch it resumes
    (the state resharded exactly), with others it is refused in one line; so is a model of
    another shape."""
    out = tmp_path / "one"
    out.mkdir()
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt")
    ckpt = ("--ckpt", str(tmp_path / "ckpt"))
    text = finish(launch(env, out, str(STEPS), *ckpt, procs=1), out, code=1)
    refusal = [line for line in text.splitlines() if "saved mid-epoch" in line]
    assert refusal and "saved by 2 processes, this job has 1" in refusal[0], text[-3000:]
    assert "keep per_device_train_batch_size x processes the same" in refusal[0]
    # 8 a device: the same 4 batches an epoch. The job had ended: nothing is trained, and the
    # weights and optimizer are the two-process job's, gathered into one process.
    text = finish(launch(env, out, str(STEPS), *ckpt, "--batch", "8", procs=1), out)
    assert f"{RESUMED} {tmp_path / 'ckpt'} at step {STEPS} " in text
    assert "saved by 2 process(es), resharded for 1" in text
    a, b = final(reference, 0), final(out, 0)
    assert not tree_differences(a["model"], b["model"])
    assert not tree_differences(a["optimizer"], b["optimizer"])
    # A wider model in the same folder: one line naming the folder and the fix.
    text = finish(launch(env, out, str(STEPS), *ckpt, "--embd", "32", procs=1), out, code=1)
    said = f"PcframeCallback: {tmp_path / 'ckpt'} holds checkpoints of another model ("
    refusal = [line for line in text.splitlines() if said in line]
    assert refusal and refusal[0].endswith(
        f"give this run its own output_dir, or pass resume=False to start over in "
        f"{tmp_path / 'ckpt'}"
    ), text[-3000:]


def test_a_dtype_the_version_was_not_saved_in_is_one_line_on_every_rank(
    tmp_path: Path, env: dict[str, str], reference: Path
) -> None:
    """The multi-rank restore's refusal listed every mismatch on lines of their own, ending
    "restore(allow_cast=True) casts tensors" (DistributedCheckpointer.restore takes no such
    argument, nor can a callback's user pass one): one line naming the folder and the fix."""
    out = tmp_path / "float64"
    out.mkdir()
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt")
    ckpt = ("--ckpt", str(tmp_path / "ckpt"), "--dtype", "float64")
    text = finish(launch(env, out, str(STEPS + 2), *ckpt), out, code=1)
    said = (
        f"pcframe.errors.StateMismatch: PcframeCallback: {tmp_path / 'ckpt'} holds checkpoints "
        "of a model in torch.float32, and this run's is in torch.float64 ("
    )
    for rank in (0, 1):
        refusal = [line for line in text.splitlines() if line.startswith(f"[rank{rank}]: {said}")]
        assert refusal and refusal[0].endswith(
            "build the model in torch.float32 as it was saved, give this run its own "
            f"output_dir, or pass resume=False to start over in {tmp_path / 'ckpt'}"
        ), text[-3000:]
    assert "allow_cast" not in text and "strict=False" not in text, text[-3000:]


def test_a_folder_one_rank_refuses_stops_every_rank_naming_it(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Each rank its own folder, rank 0's holding a one-process run's checkpoints: rank 0
    refused before the ranks agreed on anything, and rank 1 waited for it in the engine's
    open until torchrun stopped it (with NCCL: up to the group's timeout)."""
    folders = str(tmp_path / "ckpt-{rank}")
    alone = tmp_path / "alone"
    alone.mkdir()
    log = (tmp_path / "alone.log").open("a")
    subprocess.run(  # one plain process, no launcher: a one-process folder (ckpt-0)
        [sys.executable, str(CHILD), str(alone), "3", "--ckpt", folders],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, timeout=240, check=True,
    )  # fmt: skip
    out = tmp_path / "two"
    out.mkdir()
    text = finish(launch(env, out, "6", "--ckpt", folders), out, code=1)
    assert "holds the checkpoints of a one-process run" in text, text[-3000:]
    assert "rank 0 refused its folder" in text, text[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 in the Trainer needs 2 GPUs")
def test_fsdp2_sigkill_resumes_bit_identical(tmp_path: Path, env: dict[str, str]) -> None:
    """accelerate's FSDP2 runs on GPUs only (on CPU the Trainer trains DDP instead): the same
    kills with DTensor parameters, each rank saving its own shards."""
    reference, out = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    out.mkdir()
    finish(launch(env, reference, str(STEPS), "--fsdp"), reference)
    assert final(reference, 0)["dtensors"] > 0
    job = launch(env, out, str(STEPS), "--fsdp", "--kill-rank", "1", "--kill-at", "6", restarts=1)
    finish(job, out)
    assert_same_job(reference, out)
