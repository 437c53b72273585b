"""A restore the machine has too little memory for: nothing renamed, a one-line error.

Real memory pressure, no mocks: each restore runs in a child process whose address space
is capped (``RLIMIT_AS``) a little above what it already uses, so the allocations of the
restore itself are refused by the kernel, as under a cgroup limit or a busy host. A refused
allocation says nothing about the checkpoint: it must never be quarantined (renamed
``.corrupt-*``), and the restore must not fall back to an older version either.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pcframe import Checkpointer

BIG = 128 << 20  # float32 elements: 512 MiB, more than the headroom below
HEADROOM_MIB = 400  # room for the reader's threads and buffers, not for the big tensor

CHILD = """
import json, re, resource, sys, torch
from pcframe import Checkpointer
n, strided, headroom = {n}, {strided}, {headroom}
module = torch.nn.Module()
# A strided live parameter cannot be read in place: the reader allocates a fresh tensor.
module.w = torch.nn.Parameter(torch.zeros(2 * n)[::2] if strided else torch.zeros(n))
status = open("/proc/self/status").read()
used = int(re.search(r"VmSize:\\s+(\\d+)", status).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (used + (headroom << 20), resource.RLIM_INFINITY))
ckpt = Checkpointer({root!r}, model=module, read_threads=1)
try:
    out = {{"step": ckpt.restore()}}
except BaseException as exc:
    out = {{"error": type(exc).__name__, "message": str(exc)}}
out["skipped"] = [v for v, _ in ckpt.last_restore.skipped]
out["w0"] = float(module.w[0])  # the saved versions hold their step there; the live one 0
print(json.dumps(out))
"""


def save_versions(root: Path, n: int, codecs: dict[str, str]) -> None:
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(n))
    with Checkpointer(root, model=module, codecs=codecs, keep_last=3) as ckpt:
        for step in (1, 2):
            with torch.no_grad():
                module.w[0] = step
            ckpt.save(step).wait()


def restore_in_child(root: Path, n: int, *, strided: bool, headroom: int | None) -> dict:
    code = CHILD.format(n=n, strided=strided, headroom=headroom or 1 << 20, root=str(root))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def versions(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(("v", ".corrupt")))


@pytest.mark.parametrize(
    "case, codecs, strided",
    [
        ("zstd-coded tensor", {"model/*": "zstd"}, False),
        ("raw tensor read into a fresh buffer", {}, True),
    ],
)
@pytest.mark.slow
def test_refused_allocation_renames_nothing_and_names_the_memory(tmp_path, case, codecs, strided):
    save_versions(tmp_path, BIG, codecs)
    before = versions(tmp_path)
    assert before == ["v00000001", "v00000002"]

    out = restore_in_child(tmp_path, BIG, strided=strided, headroom=HEADROOM_MIB)

    assert out.get("error") == "RestoreIOError", out
    assert "version 2" in out["message"] and "out of memory" in out["message"], out
    assert "ENOMEM" in out["message"], out
    assert "\n" not in out["message"]
    assert out["skipped"] == []  # nothing judged corrupt
    assert versions(tmp_path) == before  # nothing renamed, nothing deleted
    # The same versions were good all along: with memory, the newest loads.
    assert out["w0"] == 0.0  # the live objects are as they were
    assert restore_in_child(tmp_path, BIG, strided=strided, headroom=None) == {
        "step": 2,
        "skipped": [],
        "w0": 2.0,
    }


@pytest.mark.slow
def test_refused_undo_copy_rolls_back_and_is_not_a_mismatch(tmp_path):
    """The read fits, the rollback copy of a live tensor loaded out of place does not: the
    restore is rolled back and says memory, not that the version does not fit."""
    save_versions(tmp_path, BIG, {})
    out = restore_in_child(tmp_path, BIG, strided=True, headroom=800)
    assert out.get("error") == "RestoreIOError", out
    assert "out of memory while loading model" in out["message"], out
    assert "does not fit" not in out["message"] and "\n" not in out["message"]
    assert out["w0"] == 0.0 and out["skipped"] == []
    assert versions(tmp_path) == ["v00000001", "v00000002"]


def test_a_small_manifest_needs_no_large_buffer(tmp_path):
    """Reading a manifest takes a buffer of its own size, not of the 256 MiB limit."""
    save_versions(tmp_path, 1024, {})
    out = restore_in_child(tmp_path, 1024, strided=False, headroom=200)
    assert out == {"step": 2, "skipped": [], "w0": 2.0}
