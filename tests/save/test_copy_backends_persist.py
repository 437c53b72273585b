"""The mmap persist path (on /dev/shm and on disk), how ``auto`` picks it, its crash safety."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from pcframe import Checkpointer, EngineConfig
from pcframe.format.manifest import read_manifest
from pcframe.restore.reader import load_version
from pcframe.save.persist import choose_persist
from pcframe.store.directory import CheckpointDir
from tests.helpers import small_training, state_equal, train_steps
from tests.save.test_copy_backends import recomputed_checksums_match

SHM = Path("/dev/shm")
needs_shm = pytest.mark.skipif(not SHM.is_dir(), reason="needs a tmpfs at /dev/shm")


@pytest.fixture
def shm_dir():
    path = Path(tempfile.mkdtemp(prefix="pcframe-test-", dir=SHM))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_shm
def test_auto_maps_only_persistent_memory(tmp_path, shm_dir, monkeypatch):
    import pcframe.save.persist as persist

    assert persist.mount_of(shm_dir)[1] == "tmpfs"  # the mount table is read right
    assert choose_persist(shm_dir, "auto") == "write"  # tmpfs: pwrite measured cheaper
    assert choose_persist(shm_dir, "mmap") == "mmap"  # an explicit choice stands
    for options, expected in (
        ("rw,dax", "mmap"),
        ("rw,dax=always", "mmap"),
        ("dax=never", "write"),
    ):
        monkeypatch.setattr(persist, "mount_of", lambda path, o=options: ("/pmem", "ext4", o))
        assert choose_persist(tmp_path, "auto") == expected, options
    with pytest.raises(ValueError, match=r"engine\.persist='pmem'"):
        EngineConfig(persist="pmem")


@needs_shm
@pytest.mark.parametrize("algo", ["crc32c", "pcf64", "xxh3_64", "none"])
def test_mmap_round_trip_on_shm(shm_dir, algo):
    model, optimizer, scheduler = small_training()
    train_steps(model, optimizer, scheduler, 2)
    with Checkpointer(
        shm_dir, model=model, optimizer=optimizer, checksum=algo, chunk_bytes=4096, persist="mmap"
    ) as ckpt:
        ckpt.save(step=2).wait()
    version = shm_dir / "v00000001"
    manifest = read_manifest(str(version / "manifest.json"))
    assert manifest.engine["persist"] == "mmap"
    if algo != "none":
        recomputed_checksums_match(version)
    model2, optimizer2, _ = small_training(seed=7)
    with Checkpointer(shm_dir, model=model2, optimizer=optimizer2) as ckpt:
        assert ckpt.restore() == 2
    assert state_equal(model2.state_dict(), model.state_dict())
    assert state_equal(optimizer2.state_dict()["state"], optimizer.state_dict()["state"])


def test_mmap_on_disk_when_asked(tmp_path):
    model = torch.nn.Linear(100, 50)
    with Checkpointer(tmp_path, model=model, persist="mmap", chunk_bytes=8192) as ckpt:
        ckpt.save(step=1).wait()
    assert read_manifest(str(tmp_path / "v00000001" / "manifest.json")).engine["persist"] == "mmap"
    recomputed_checksums_match(tmp_path / "v00000001")
    named = load_version(tmp_path / "v00000001").named_tensors()
    assert torch.equal(named["model/weight"], model.weight.detach())


SAVER = r"""
import sys, torch
from pcframe import Checkpointer


from tests.stamp import StepStampOptimizer

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
opt = StepStampOptimizer(model.parameters(), moments=True)
codecs = {"model/*": "xor_delta_zstd", "optimizer/state/*/exp_avg": "int8_block"}
with Checkpointer(sys.argv[1], model=model, optimizer=opt, chunk_bytes=8192, persist="mmap",
                  codecs=codecs, full_every=3, max_in_flight=2, keep_last=1) as ckpt:
    step = ckpt.restore() or 0
    opt.count = step
    print("ready", step, flush=True)
    while True:
        step += 1
        opt.step()
        ckpt.save(step)
"""


def check_recovers(root: Path) -> int:
    """The newest committed version loads, verifies and holds one step everywhere."""
    directory = CheckpointDir(root)
    versions = directory.committed_versions()
    assert versions, "nothing committed"
    loaded = load_version(directory.path(versions[-1]))
    step = loaded.manifest.step
    for name, tensor in loaded.named_tensors().items():
        if name.startswith("model/"):
            assert torch.all(tensor == float(step)), (name, step)
        if name.endswith("exp_avg"):  # int8: within the bound the manifest records
            bound = loaded.manifest.error_bound(name)
            assert (tensor - float(step)).abs().max() <= bound, (name, step)
    return step


@needs_shm
@pytest.mark.parametrize("point", ["chunk_written:7", "segment_written:9", "data_synced:3"])
@pytest.mark.slow
def test_sigkill_with_mmap_codecs_and_deltas_recovers(shm_dir, python, child_env, point):
    first = subprocess.Popen(
        [python, "-c", SAVER, str(shm_dir)], env=child_env, text=True, stdout=subprocess.PIPE
    )
    assert first.stdout.readline().startswith("ready")
    deadline = time.monotonic() + 120
    while len(CheckpointDir(shm_dir).committed_versions()) < 2:  # (compiles kernels first)
        assert time.monotonic() < deadline and first.poll() is None, "saver made no progress"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    first.stdout.close()
    before = check_recovers(shm_dir)
    child_env["PCFRAME_CRASH_AT"] = point
    crashing = subprocess.Popen(
        [python, "-c", SAVER, str(shm_dir)], env=child_env, text=True, stdout=subprocess.PIPE
    )
    line = crashing.stdout.readline()
    assert int(line.split()[1]) == before
    assert crashing.wait(timeout=120) == -signal.SIGKILL
    crashing.stdout.close()
    assert check_recovers(shm_dir) >= before
