"""Opening a multi-rank checkpoint: every rank opens its shard directory, all agree.

Each rank opens its local engine on ``root/rank-<r>/``. Then two collectives:

1. the next version number is above everything any rank, record, pointer or the object
   store has used, so a number is never reused for different contents (a crashed run may
   have left local-only versions), and a failure on any rank is raised on every rank, so a
   rank that cannot open its directory never leaves the others waiting in the first
   collective of a save; each rank also says which node it is on
   (:func:`~pcframe.distributed.nodes.node_key`) and leaves a marker file named after a
   token of its own in its root;
2. each rank says which ranks' markers it sees: ranks that see each other's share a root
   (one shared file system, or one node's local disk), and the lowest of them leads that
   root: it keeps the root's copies of the global records and lists them here, so the
   retained global versions are those of every root, not rank 0's alone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pcframe.checkpointer import Checkpointer
from pcframe.distributed import global_versions
from pcframe.distributed.nodes import NodeMap, node_key
from pcframe.distributed.peers import peers
from pcframe.errors import CheckpointError

_MARKER = ".pcframe-open-"  # + a rank's token: which ranks see which roots


@dataclass(frozen=True)
class Opened:
    local: Checkpointer  # this rank's engine
    next_version: int  # the next version number, the same on every rank
    retained: list[int]  # the global versions whose records are valid (in any root)
    nodes: NodeMap  # which ranks share a node
    groups: tuple[int, ...]  # per rank, the lowest rank that shares its root (its leader)


def open_shards(
    root: Path,
    open_local: Callable[[], Checkpointer],
    control: Any,
    report: Any,
    node: str | None = None,
    remote_newest: Callable[[], int] = lambda: 0,
    same: tuple[tuple[str, Any], ...] = (),
) -> Opened:
    """Open this rank's engine with ``open_local`` and agree with the others (collective).

    ``remote_newest``: the newest version the job's object store holds, where the engines
    did not list it (:func:`~pcframe.distributed.job_tiers.start_job_listing`). ``same``:
    ``(name, value)`` of the options every rank must be given alike (those that decide which
    collectives a rank enters: one given otherwise would leave the others waiting in one).

    On a failure anywhere the engine is closed again, both process groups are destroyed and
    the error is raised on every rank (this rank's own, or one naming the failing rank).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local, mine, error = None, None, ""
    token, marker = secrets.token_hex(8), None
    try:
        local = open_local()
        marker = root / f"{_MARKER}{token}"
        marker.touch()
    except (CheckpointError, OSError, TypeError, ValueError) as exc:
        mine, error = exc, f"{type(exc).__name__}: {exc}"
    try:
        top = max(local.next_version if local else 0, remote_newest() + 1)
        row = (top, node_key(node), token, same, error)
        first = _agree(row, world_size, control, mine, local, report)
        mine = None
        differing = _differing(same, [s for _, _, _, s, _ in first])
        if differing:
            _give_up(local, report, control)
            raise CheckpointError(
                f"the ranks were given different DistributedCheckpointer options: {differing}; "
                "give every rank the same ones"
            )
        try:  # who shares this root: the ranks whose markers it holds (its own among them)
            tokens = [t for _, _, t, _, _ in first]
            group = min(r for r, t in enumerate(tokens) if (root / f"{_MARKER}{t}").exists())
            retained, newest_record, error = [], 0, ""
            if group == rank:  # this root's leader lists its records
                global_versions.remove_partial_records(root)
                records, _ = global_versions.valid_records(root)
                retained = sorted(r.version for r in records)
                newest_record = max(global_versions.record_versions(root), default=0)
        except (CheckpointError, OSError, ValueError) as exc:
            mine, error = exc, f"{type(exc).__name__}: {exc}"
            group, retained, newest_record = rank, [], 0
        row = (group, retained, newest_record, error)
        second = _agree(row, world_size, control, mine, local, report)
    finally:  # every rank has looked once the second collective is over
        with contextlib.suppress(OSError):
            if marker is not None:
                os.unlink(marker)
    assert local is not None
    groups = tuple(g for g, _, _, _ in second)
    top = max([t for t, _, _, _, _ in first] + [n + 1 for _, _, n, _ in second])
    retained = sorted({v for _, kept, _, _ in second for v in kept})
    return Opened(local, top, retained, NodeMap(tuple(k for _, k, _, _, _ in first)), groups)


def _differing(mine: tuple[tuple[str, Any], ...], everyone: list[Any]) -> str:
    """The options not alike on every rank, each with what each rank was given ("")."""
    parts = []
    for name, _ in mine:
        values = [dict(theirs).get(name) if theirs else None for theirs in everyone]
        if len({repr(v) for v in values}) > 1:
            given = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            parts.append(f"{name} ({given})")
    return "; ".join(parts)


def _give_up(local: Checkpointer | None, report: Any, control: Any) -> None:
    """Close this rank's engine and destroy both groups: the open failed on every rank."""
    if local is not None:
        local.close()
    dist.destroy_process_group(report)
    dist.destroy_process_group(control)


def _agree(
    row: tuple[Any, ...],
    world_size: int,
    control: Any,
    mine: BaseException | None,
    local: Checkpointer | None,
    report: Any,
) -> list[tuple[Any, ...]]:
    """All-gather ``row`` (its last field: this rank's error, or ""); on an error anywhere,
    close this rank's engine, destroy both groups and raise on every rank."""
    gathered: list[Any] = [None] * world_size
    try:
        with peers("opening the checkpoint"):
            dist.all_gather_object(gathered, row, group=control)
    except CheckpointError as exc:  # a peer is gone: nothing to agree with
        gathered, mine = [(*row[:-1], str(exc))], mine or exc
    failed = [(r, g[-1]) for r, g in enumerate(gathered) if g[-1]]
    if failed:
        _give_up(local, report, control)
        if mine is not None:
            raise mine
        other, message = failed[0]
        raise CheckpointError(f"rank {other} could not open its checkpoint shard: {message}")
    return gathered
