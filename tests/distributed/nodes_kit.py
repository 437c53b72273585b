"""Jobs of 4 real gloo ranks as 2 "nodes" that share nothing (each its own root and memory
folder), for the peer tier's tests: ``tests.distributed.worker nodes`` runs one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.distributed.launch import run_job

NODES = {0: "a", 1: "a", 2: "b", 3: "b"}


def job(
    tmp: Path, root: Path, tag: str, steps: int, *extra: str, nodes: dict | None = None
) -> list[dict]:
    """One run of the ``nodes`` scenario (4 ranks as nodes a, a, b, b unless ``nodes``)."""
    nodes = nodes or NODES
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    args = ["nodes", "--root", str(root), "--out", str(out), "--tag", tag, "--steps", str(steps)]
    env = {rank: {"PCFRAME_NODE": node} for rank, node in nodes.items()}
    logs = tmp / f"logs-{tag}"
    run_job(len(nodes), [*args, "--sync", *extra], logs, rank_env=env, timeout=240).check()
    return [json.loads((out / f"nodes-{tag}-r{r}.json").read_text()) for r in range(len(nodes))]


def final(tmp: Path, tag: str, rank: int, at: int | None = None) -> dict:
    suffix = "" if at is None else f"-at{at}"
    return load_file(tmp / "out" / f"nodes-{tag}-r{rank}{suffix}.safetensors")


def lose_node(root: Path, node: str) -> None:
    """The VM is gone: its local disk and its memory with it."""
    shutil.rmtree(root / node)
    shutil.rmtree(root / f"{node}-shm", ignore_errors=True)


def assert_same_as_reference(tmp: Path, tag: str, at: int, end: int = 12) -> None:
    """Restored at step ``at`` exactly as the uninterrupted run was there; trained on to
    step ``end`` as it was there too (closely: see the module docstring)."""
    for rank in range(4):
        expected, got = final(tmp, "reference", rank, at), final(tmp, tag, rank, at)
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(expected[key], got[key]), (rank, key, "restored")
        expected, got = final(tmp, "reference", rank, end), final(tmp, tag, rank)
        for key in expected:
            assert torch.allclose(expected[key], got[key], rtol=1e-5, atol=1e-6), (rank, key)
