"""The staging pool is allocated, pages faulted in, before the first save (SavePipeline.prepare).

The first save used to allocate the pool itself: 3-20x a later save's stall on a 2-core VM
(page faults in the copy), and 10 s of pinning for a 12 GiB pool on an H200 host.
"""

from __future__ import annotations

import resource
import time

import torch

import pcframe.policies as P
from pcframe import Checkpointer
from tests.helpers import small_training, train_steps

CHUNK = 4096


def _warmed(ckpt: Checkpointer, timeout: float = 30.0) -> bool:
    thread = ckpt._pipeline._warming
    if thread is None:
        return False
    thread.join(timeout)
    return not thread.is_alive()


def test_a_declined_maybe_save_sizes_the_pool_once_the_optimizer_has_state(tmp_path):
    model, optimizer, scheduler = small_training()
    policy = P.FixedSteps(1000)  # declines every step here
    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, policy=policy, chunk_bytes=CHUNK
    ) as ckpt:
        assert ckpt.maybe_save(0) is None
        # no moments yet: the state's size is not final, nothing is allocated
        assert ckpt._pipeline._warming is None and ckpt.staging_bytes == 0
        train_steps(model, optimizer, scheduler, 1)
        assert ckpt.maybe_save(1) is None
        assert _warmed(ckpt)
        nbytes, on_cuda = ckpt._capture.footprint()
        assert not on_cuda
        assert ckpt.staging_bytes >= nbytes  # staging_ratio 1.0: one version
        capacity = ckpt.staging_bytes
        ckpt.save(step=1).wait()  # the same pool: no second allocation
        assert ckpt.staging_bytes == capacity
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() == 1


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_the_warm_pool_is_resident_before_any_save(tmp_path):
    """Faulted in on the warming thread: resident memory grows by the pool there, so the
    first save's copy writes into resident pages."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)  # 16 MiB of weights, 48 MiB with Adam's moments
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()
    policy = P.FixedSteps(1000)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=policy) as ckpt:
        before = _resident_bytes()
        assert ckpt.maybe_save(1) is None
        assert _warmed(ckpt)
        grown = _resident_bytes() - before
        assert grown >= 0.9 * ckpt.staging_bytes >= 0.9 * 48 * 2**20


def test_close_while_the_pool_is_warming_does_not_hang_or_keep_it(tmp_path, monkeypatch):
    import pcframe.save.staging as staging

    original = staging.StagingPool._allocate

    def slow_allocate(self, count, pinned):
        time.sleep(0.5)
        return original(self, count, pinned)

    monkeypatch.setattr(staging.StagingPool, "_allocate", slow_allocate)
    model, optimizer, scheduler = small_training()
    train_steps(model, optimizer, scheduler, 1)
    started = time.monotonic()
    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, policy=P.FixedSteps(1000)
    ) as ckpt:
        assert ckpt.maybe_save(1) is None
        pool = ckpt._pipeline.pool
    assert time.monotonic() - started < 10
    assert _warmed(ckpt)
    assert not pool._free  # closed: nothing kept


class TwoBranches(torch.nn.Module):
    """A branch that first gets a gradient later (a mixture of experts' expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)

    def forward(self, x: torch.Tensor, both: bool) -> torch.Tensor:
        return self.a(x) + (self.b(x) if both else 0)


def test_the_pool_grows_ahead_when_a_branch_first_gets_its_moments(tmp_path):
    torch.manual_seed(0)
    model = TwoBranches()
    optimizer = torch.optim.Adam(model.parameters())
    policy = P.FixedSteps(1000)

    def step(both: bool) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(2, 512), both).sum().backward()
        optimizer.step()

    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, policy=policy, chunk_bytes=1 << 20
    ) as ckpt:
        step(False)
        assert ckpt.maybe_save(1) is None and _warmed(ckpt)
        first = ckpt.staging_bytes
        step(True)  # b's moments now exist: the state is larger
        assert ckpt.maybe_save(2) is None and _warmed(ckpt)
        nbytes, _ = ckpt._capture.footprint()
        assert ckpt.staging_bytes >= nbytes > first


def test_an_optimizer_without_state_is_sized_after_its_first_step(tmp_path):
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no state ever
    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, policy=P.FixedSteps(1000)
    ) as ckpt:
        assert ckpt.maybe_save(0) is None
        assert ckpt._pipeline._warming is None  # not stepped yet: not known to be final
        model(torch.randn(2, 64)).sum().backward()
        optimizer.step()
        assert ckpt.maybe_save(1) is None and _warmed(ckpt)
        assert ckpt.staging_bytes > 0


def test_a_pool_a_save_sized_is_not_resized_by_a_late_warm_up():
    from pcframe.save.staging import StagingPool

    pool = StagingPool(CHUNK)
    pool.ensure(8 * CHUNK, pinned=False)  # the first save's own sizing
    pool.ensure(2 * CHUNK, pinned=False, touch=True)  # a warm thread that lost the race
    assert pool.capacity_bytes == 8 * CHUNK


def test_a_warm_up_that_cannot_start_its_thread_does_not_stop_training(tmp_path, monkeypatch):
    """The pool ahead of the first save is an optimisation: when no thread can be started
    (a process at its thread limit), decide() still answers and the first save allocates."""
    import pcframe.save.pipeline as pipeline

    class NoThread(pipeline.threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    model, optimizer, scheduler = small_training()
    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, policy=P.FixedSteps(1000), chunk_bytes=CHUNK
    ) as ckpt:
        train_steps(model, optimizer, scheduler, 1)
        with monkeypatch.context() as patch:
            patch.setattr(pipeline.threading, "Thread", NoThread)
            assert ckpt.maybe_save(1) is None  # declined, and no exception
        assert ckpt.staging_bytes == 0
        ckpt.save(step=1).wait()  # the save allocates the pool itself
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() == 1
