"""Shared by the framework-integration tests: SIGKILL a training child at random points and
compare the final pcframe versions of two runs tensor by tensor."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pcframe.restore.reader import load_version
from pcframe.store.directory import CheckpointDir


def newest(directory: Path) -> int:
    if not directory.exists():
        return 0
    return max(CheckpointDir(directory).committed_versions(), default=0)


def final_version(directory: Path) -> tuple[int, dict[str, torch.Tensor], Any]:
    """(step, tensors by name, decoded state tree) of the newest committed version."""
    store = CheckpointDir(directory)
    loaded = load_version(store.path(store.committed_versions()[-1]))
    return loaded.manifest.step, loaded.named_tensors(), loaded.state_tree()


def kill_and_resume(
    start: Callable[[], subprocess.Popen], directory: Path, kills: int, seed: int
) -> int:
    """Start, SIGKILL after a further commit plus a seeded random delay, ``kills`` times;
    then let the last start finish. Returns how many kills landed."""
    rng, landed = random.Random(seed), 0
    while True:
        proc = start()
        if landed == kills:
            assert proc.wait(timeout=300) == 0, "the last (unkilled) run failed"
            return landed
        before = newest(directory)
        deadline = time.monotonic() + 120
        while newest(directory) <= before:  # kill only after one more version committed
            if proc.poll() is not None:
                assert proc.returncode == 0, f"child failed with {proc.returncode}"
                return landed  # finished before it could be killed again
            assert time.monotonic() < deadline, "no version committed"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.15))  # somewhere between two versions
        proc.send_signal(signal.SIGKILL)
        code = proc.wait(timeout=60)
        if code == 0:
            return landed  # it finished in the delay
        assert code == -signal.SIGKILL
        landed += 1


def tensor_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())}"
    return [k for k in a if not torch.equal(a[k], b[k])]


def tree_differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two decoded state trees differ (tensors compared with torch.equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}" for k in a.keys() ^ b.keys()]
        for k in a.keys() & b.keys():
            out += tree_differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in tree_differences(x, y, f"{path}/{i}")
        ]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if torch.equal(a, b) else [path]
    return [] if type(a) is type(b) and a == b else [f"{path} ({a!r:.40} != {b!r:.40})"]
