"""The engine's threads never start OpenMP thread teams of their own (pcframe.runtime.threads).

A team made by a background thread put GNU OpenMP past one thread per core, and the training
step then ran about 45 % slower for as long as the engine lived. The test checks the cause,
not the timing: after saves through every stage, every OS thread of the process that did
not exist before is a Python thread (the engine's own), and the training thread's torch
thread count is untouched.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pcframe import Checkpointer, EngineConfig
from pcframe.runtime.threads import single_threaded_torch

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def os_threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def python_threads() -> set[int]:
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


@pytest.mark.parametrize(
    "engine",
    [
        {"copy_backend": "torch"},
        {"copy_backend": "torch", "codecs": {"*": "zstd"}},
        {
            "copy_backend": "torch",
            "codecs": {"optimizer/state/*/exp_avg*": "int8_block"},
            "full_every": 2,
        },
    ],
    ids=["raw", "zstd", "int8-delta"],
)
def test_saves_make_no_openmp_teams(tmp_path, engine):
    threads_before = torch.get_num_threads()
    if threads_before < 2:
        torch.set_num_threads(2)  # a team exists only where ops can run in parallel
    try:
        big = torch.nn.Linear(2048, 2048)  # 16 MiB: large enough for parallel copies
        optimizer = torch.optim.Adam(big.parameters())
        big(torch.randn(8, 2048)).sum().backward()  # the training thread's own team
        optimizer.step()
        config = EngineConfig(chunk_bytes=1 << 20, writer_threads=2, **engine)

        def save_three(directory) -> Checkpointer:
            ckpt = Checkpointer(directory, model=big, optimizer=optimizer, config=config)
            for step in range(1, 4):
                ckpt.wait_for_snapshot()  # an edit outside optimizer.step() waits for the copy
                with torch.no_grad():
                    big.weight.add_(1.0)
                ckpt.save(step)
            ckpt.wait()
            return ckpt

        # A first engine, closed again: one-time set-up threads (Numba's, on its first
        # kernel call in the process) are not the engine's doing.
        save_three(tmp_path / "warm-up").close()
        before = os_threads()
        with save_three(tmp_path / "measured"):
            strangers = os_threads() - before - python_threads()
            assert not strangers, f"threads outside Python started by the engine: {strangers}"
            assert torch.get_num_threads() == max(threads_before, 2)
    finally:
        torch.set_num_threads(threads_before)


def test_single_threaded_torch_limits_only_the_calling_thread():
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []

    def engine_thread() -> None:
        single_threaded_torch()
        seen.append(torch.get_num_threads())

    try:
        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        assert seen == [1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads_before)
