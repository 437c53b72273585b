"""Small models and state used across engine tests."""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

import pytest
import torch
from torch import nn

# A test parametrized over these runs on the CPU everywhere (the twin) and on CUDA where
# there is a GPU (marked gpu).
CPU_AND_CUDA = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


def small_training(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return model, optimizer, scheduler


def train_steps(model: nn.Module, optimizer, scheduler, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        inputs = torch.randn(8, 16, generator=generator)
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def state_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif isinstance(x, dict):
            if not (isinstance(y, dict) and state_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def flip_byte(path, offset: int) -> None:
    """Flip one bit pattern (0x40) of the byte at ``offset`` (modulo the size) in place."""
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(offset % size)
        byte = f.read(1)
        f.seek(offset % size)
        f.write(bytes([byte[0] ^ 0x40]))


class StateBox:
    """A stateful object whose state is whatever the test puts in it."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def disk_reads_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restores read every chunk from disk: the staging pool reports no chunk it still
    holds (:mod:`pcframe.restore.staged`), so a rollback takes the disk path a test is about."""
    from pcframe.save.staging import StagingPool

    monkeypatch.setattr(StagingPool, "holding", lambda self, lent: {})


def adamw_mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two linear layers with AdamW, one step taken (the moments exist): ~80k parameters,
    a few chunks at 64 KiB."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    adamw_step(model, optimizer)
    return model, optimizer


def adamw_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 256)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def live_values(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every live value a restore may write, copied."""
    values = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, per_param in enumerate(optimizer.state.values()):
        values.update({f"opt/{i}/{k}": v.clone() for k, v in per_param.items()})
    return values


def same_values(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class DiskFull:
    """``os`` for pcframe's writer threads, whose ``pwrite`` fails with ENOSPC once ``full``."""

    def __init__(self) -> None:
        self.full = False
        self.refused = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def pwrite(self, *args: Any) -> int:
        if self.full:
            self.refused.set()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.pwrite(*args)


class _InSaveOrder:
    """The commit queue of a pipeline, handing versions on in the order they were saved."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue
        self._lock = threading.Lock()
        self._saved: list[object] = []  # the requests submitted and not yet handed on
        self._done: dict[int, object] = {}  # id(request) -> its write, finished early

    def submitted(self, request: object) -> None:
        with self._lock:
            self._saved.append(request)

    def not_submitted(self, request: object) -> None:
        with self._lock:
            self._saved.remove(request)
            self._release()

    def put(self, write: Any) -> None:
        if write is None:  # close(): every version was handed on already
            self._queue.put(None)
            return
        with self._lock:
            self._done[id(write.request)] = write
            self._release()

    def _release(self) -> None:
        while self._saved and id(self._saved[0]) in self._done:
            self._queue.put(self._done.pop(id(self._saved.pop(0))))

    def get(self) -> Any:
        return self._queue.get()

    def qsize(self) -> int:
        return self._queue.qsize()


def commits_in_save_order(engine: Any) -> None:
    """Make ``engine``'s commit thread take versions in the order they were saved.

    It takes them in the order their writes finish, and discards (by design) a version
    that finishes after a newer one was published: with several versions in flight, which
    ones commit depends on the machine's load. A test that is not about that order, and
    asserts every version commits, calls this before its first save: a version finished
    early waits for the ones saved before it (none of which waits for it)."""
    pipeline = engine._pipeline
    assert not pipeline.started, "call commits_in_save_order() before the first save"
    ordered = _InSaveOrder(pipeline._commit_queue)
    submit = pipeline.submit

    def submitted(request: Any, progress: Any) -> None:
        ordered.submitted(request)  # before: its writes may finish before submit returns
        try:
            submit(request, progress)
        except BaseException:
            ordered.not_submitted(request)
            raise

    pipeline._commit_queue = ordered
    pipeline.submit = submitted
