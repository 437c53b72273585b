"""Child processes of the DCP storage tests: real ranks on gloo, real SIGKILLs.

Run as ``python -m tests.integrations.dcp_ranks SCENARIO ROOT`` with the torchrun
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); :func:`run_ranks` starts a job.

The training state of step ``k`` is exact by construction (parameters filled, gradients set,
one AdamW step per step: elementwise maths only), so the parent process rebuilds the very
same bits with :func:`training_state` and compares a loaded state with ``==``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.distributed.launch import REPO, base_env, free_port

SHARDED = (8, 6)  # the global shape of the DTensor the ranks shard by rows


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def trained(step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and AdamW after ``step`` deterministic steps (the same on every process)."""
    net = model()
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            p.copy_(torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape) * (i + 1))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    for k in range(1, step + 1):
        for i, p in enumerate(net.parameters()):
            ramp = torch.linspace(0, 1, p.numel()).reshape(p.shape)
            p.grad = torch.full_like(p, 0.01 * k * (i + 1)) + ramp
        opt.step()
    return net, opt


def sharded_value(step: int) -> torch.Tensor:
    return torch.arange(SHARDED[0] * SHARDED[1], dtype=torch.float32).reshape(SHARDED) + step


def training_state(step: int) -> dict[str, Any]:
    """What a save at ``step`` holds, as one process sees it (for the comparisons)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net, opt = trained(step)
    msd, osd = get_state_dict(net, opt)
    return {"model": msd, "optim": osd, "step": step}


def fresh_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """A model and optimizer with other values, and the state dict DCP loads into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net, opt = trained(7)
    for group in opt.param_groups:
        group["lr"] = 99.0
    msd, osd = get_state_dict(net, opt)
    return net, opt, {"model": msd, "optim": osd, "step": -1}


def assert_loaded(net: torch.nn.Module, opt: torch.optim.Optimizer, state: dict, step: int) -> None:
    """``state`` (loaded by DCP) applied to ``net``/``opt`` equals the state of ``step``."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ref_net, ref_opt = trained(step)
    for (name, a), b in zip(net.state_dict().items(), ref_net.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"model {name} differs"
    got, want = opt.state_dict(), ref_opt.state_dict()
    assert got["param_groups"] == want["param_groups"], (got["param_groups"], want["param_groups"])
    for key, entries in want["state"].items():
        for name, value in entries.items():
            assert torch.equal(got["state"][key][name], value), f"optimizer {key}/{name} differs"
    assert state["step"] == step, state["step"]


# --- scenarios (in the rank processes) ------------------------------------------------------


def _two_ranks(root: Path) -> None:
    """Saves 1..3 (keep_last=2), an async save with DefaultStager, a 2-rank load of it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pcframe.integrations.dcp import StorageReader, StorageWriter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def state_of(step: int) -> dict[str, Any]:
        state = training_state(step)
        state["sharded"] = distribute_tensor(sharded_value(step), mesh, [Shard(0)])
        state[f"rank{rank}"] = torch.full((3,), float(10 * rank + step))
        return state

    for step in (1, 2, 3):
        dcp.save(state_of(step), storage_writer=StorageWriter(root, keep_last=2, step=step))
    stager = DefaultStager(StagingOptions(False, False, True, False))
    response = dcp.async_save(
        state_of(4), storage_writer=StorageWriter(root, keep_last=2, step=4), async_stager=stager
    )
    response.upload_completion.result()
    stager.close()

    net, opt, state = fresh_state()
    state["sharded"] = distribute_tensor(torch.zeros(SHARDED), mesh, [Shard(0)])
    state[f"rank{rank}"] = torch.zeros(3)
    dcp.load(state, storage_reader=StorageReader(root))
    assert_loaded(net, opt, state, 4)
    assert torch.equal(state["sharded"].full_tensor(), sharded_value(4))
    assert torch.equal(state[f"rank{rank}"], torch.full((3,), float(10 * rank + 4)))
    dist.barrier()
    dist.destroy_process_group()
    print("ok", flush=True)
    # Everything this scenario checks is done. Leave without interpreter teardown: once in a
    # clean-clone run a rank aborted there ("terminate called without an active exception",
    # a C++ thread of torch's own at exit) after printing ok.
    os._exit(0)


def _saves(root: Path) -> None:
    """One process saving steps 1, 2, ... (tiny chunks: many chunk writes per version).

    Prints ``committed <step>`` after each save returned; a crash point (PCFRAME_CRASH_AT) or
    the parent's SIGKILL ends it somewhere inside a save.
    """
    import torch.distributed.checkpoint as dcp

    from pcframe.integrations.dcp import StorageWriter

    writer_options = {"keep_last": 1, "chunk_bytes": 4096, "writer_threads": 2}
    padding = int(os.environ.get("DCP_TEST_PADDING", "0"))
    for step in range(1, int(os.environ.get("DCP_TEST_STEPS", "3")) + 1):
        state = training_state(step)
        state["padding"] = torch.full((padding + 4096,), float(step))
        dcp.save(state, storage_writer=StorageWriter(root, step=step, **writer_options))
        print(f"committed {step}", flush=True)


def conj_value(step: int) -> torch.Tensor:
    """A lazy conjugate view (its bytes are not its values), as a state may hold one."""
    return (torch.arange(6.0).to(torch.complex64) * (1 + 2j) + step).conj()


def _sharded(root: Path) -> None:
    """Two ranks save versions 1..3 of a state with a row-sharded DTensor and a conjugate
    view, then load as the DCP reader tests need real ranks to:

    1. version 3 is committed (its global record put in place) by rank 0 only after rank
       0's load chose version 2, and rank 1 loads once it is there: every rank reads version
       3, the newest any rank chose, none a mix of two versions;
    2. a copy of the root (``<root>-pristine``) is left for the parent's tests;
    3. rank 1's data of version 3 is damaged in every chunk, and both ranks load it with the
       DTensor replicated (each reads both shards): it fails on each rank, and neither rank's
       live parameters, optimizer state or tensors changed; version 2 then loads;
    4. only rank 1's reads fail: rank 0, whose own verify, places nothing either;
    5. only rank 1's destination cannot take its tensor: rank 0 places nothing either.
    """
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from pcframe.errors import CorruptCheckpoint
    from pcframe.format.manifest import DATA_NAME, read_manifest
    from pcframe.integrations.dcp import StorageReader, StorageWriter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def state_of(step: int) -> dict[str, Any]:
        state = training_state(step)
        state["sharded"] = distribute_tensor(sharded_value(step), mesh, [Shard(0)])
        state["conj"] = conj_value(step)
        return state

    def fresh(placement: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
        net, opt, state = fresh_state()
        state["sharded"] = distribute_tensor(torch.zeros(SHARDED), mesh, [placement])
        state["conj"] = torch.zeros(6, dtype=torch.complex64)
        return net, opt, state

    def check(net: Any, opt: Any, state: dict[str, Any], step: int) -> None:
        assert_loaded(net, opt, state, step)
        assert torch.equal(state["sharded"].full_tensor(), sharded_value(step))
        assert torch.equal(state["conj"], conj_value(step).resolve_conj())

    for step in (1, 2, 3):
        dcp.save(state_of(step), storage_writer=StorageWriter(root, keep_last=3, step=step))
    record, staged = root / "global" / "v00000003.json", root / "staged-v00000003.json"
    dist.barrier()
    if rank == 0:
        os.rename(record, staged)  # version 3 not committed yet
    dist.barrier()

    class CommitsVersion3(DefaultLoadPlanner):
        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            super().set_up_planner(*args, **kwargs)  # read_metadata has chosen version 2
            os.rename(staged, record)

    net, opt, state = fresh(Shard(0))
    if rank == 0:
        reader = StorageReader(root)
        dcp.load(state, storage_reader=reader, planner=CommitsVersion3())
    else:
        while not record.exists():
            time.sleep(0.01)
        reader = StorageReader(root)
        dcp.load(state, storage_reader=reader)
    check(net, opt, state, 3)
    assert reader.loaded is not None and reader.loaded.version == 3
    dist.barrier()
    if rank == 0:
        shutil.copytree(root, root.with_name(root.name + "-pristine"))
        damaged = root / "rank-1" / "v00000003"
        manifest = read_manifest(str(damaged / "manifest.json"))
        with open(damaged / DATA_NAME, "r+b") as f:
            for chunk in manifest.chunks:
                f.seek(chunk.offset)
                byte = f.read(1)
                f.seek(chunk.offset)
                f.write(bytes([byte[0] ^ 0x40]))
    dist.barrier()

    net, opt, state = fresh(Replicate())
    before = [t.clone() for t in _live_tensors(net, opt, state)]
    try:
        dcp.load(state, storage_reader=StorageReader(root))
    except CheckpointException as exc:
        failure = exc.failures[rank]
        error = failure[0] if isinstance(failure, tuple) else failure
        assert isinstance(error, CorruptCheckpoint), repr(error)
        assert "rank-1/v00000003/data.bin" in str(error) and "\n" not in str(error), str(error)
        assert "nothing was placed" in str(error), str(error)
    else:
        raise AssertionError("a damaged version loaded")
    after = _live_tensors(net, opt, state)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "changed"
    dcp.load(state, storage_reader=StorageReader(root, version=2))
    check(net, opt, state, 2)

    # 4. Only rank 1's part fails (its reads refused): rank 0, whose own reads verify, places
    # nothing either, and says which rank failed.
    class RefusingReader(StorageReader):
        def _read_all(self, *args: Any) -> Any:
            raise CorruptCheckpoint("rank 1's reads refused (injected)")

    net, opt, state = fresh(Shard(0))
    before = [t.clone() for t in _live_tensors(net, opt, state)]
    reader = RefusingReader(root, version=2) if rank == 1 else StorageReader(root, version=2)
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as exc:
        failure = exc.failures[rank]
        error = failure[0] if isinstance(failure, tuple) else failure
        if rank == 0:
            assert "rank 1 failed" in str(error) and "injected" in str(error), str(error)
            assert "nothing was placed on this rank" in str(error), str(error)
    else:
        raise AssertionError("a load with a failed rank placed its state")
    after = _live_tensors(net, opt, state)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "changed"

    # 5. Only rank 1's destination cannot take a tensor (a broadcast view): every shard
    # verifies on both ranks, and rank 0 had placed its part when rank 1 refused its own.
    net, opt, state = fresh(Shard(0))
    if rank == 1:
        state["conj"] = torch.zeros(1, dtype=torch.complex64).expand(6)
    before = [t.clone() for t in _live_tensors(net, opt, state)]
    try:
        dcp.load(state, storage_reader=StorageReader(root, version=2))
    except CheckpointException as exc:
        failure = exc.failures[rank]
        error = failure[0] if isinstance(failure, tuple) else failure
        expected = "rank 1 failed" if rank == 0 else "broadcast view"
        assert expected in str(error), str(error)
    else:
        raise AssertionError("a load one rank could not place was placed")
    after = _live_tensors(net, opt, state)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "changed"
    dist.barrier()
    dist.destroy_process_group()
    print("ok", flush=True)
    os._exit(0)  # as _two_ranks: no interpreter teardown once everything is checked


def _live_tensors(net: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> list:
    """Every tensor a load into ``state`` could change: parameters, optimizer state, the
    DTensor's local part and the plain tensors."""
    tensors = [p.detach() for p in net.parameters()]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors += [state["sharded"].to_local(), state["conj"]]
    return tensors


def _sharded_saves(root: Path) -> None:
    """Two ranks saving versions 1, 2, ... of a state with a row-sharded DTensor, with
    ``keep_last=1``, until killed (prints ``committed <step>`` on rank 0 after each)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pcframe.integrations.dcp import StorageWriter

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for step in range(1, int(os.environ.get("DCP_TEST_STEPS", "3")) + 1):
        state = training_state(step)
        state["sharded"] = distribute_tensor(sharded_value(step), mesh, [Shard(0)])
        dcp.save(state, storage_writer=StorageWriter(root, keep_last=1, step=step))
        if dist.get_rank() == 0:
            print(f"committed {step}", flush=True)
    dist.destroy_process_group()
    os._exit(0)


SCENARIOS = {
    "two_ranks": _two_ranks,
    "saves": _saves,
    "sharded": _sharded,
    "sharded_saves": _sharded_saves,
}


# --- the parent's side ---------------------------------------------------------------------


def run_ranks(
    world_size: int, scenario: str, root: Path, timeout: float = 120.0, env: dict | None = None
) -> list[tuple[int, str]]:
    """Run ``scenario`` on ``world_size`` rank processes; (returncode, output) per rank.

    As torchrun does, a rank that dies takes the others down (SIGKILL).
    """
    base = {**base_env(), "WORLD_SIZE": str(world_size), "MASTER_PORT": str(free_port())}
    base.update(env or {})
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.integrations.dcp_ranks", scenario, str(root)],
            cwd=REPO,
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                time.sleep(0.3)
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGKILL)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.wait(), p.stdout.read() if p.stdout else "") for p in procs]


if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](Path(sys.argv[2]))
