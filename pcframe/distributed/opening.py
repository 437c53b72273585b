"""Opening a multi-rank checkpoint: every rank opens its shard directory, all agree.

Each rank opens its local engine on ``root/rank-<r>/``; rank 0 also lists the global
records. Then one collective: the next version number is above everything any rank or
record has used, so a number is never reused for different contents (a crashed run may
have left local-only versions), and a failure on any rank is raised on every rank, so a
rank that cannot open its directory never leaves the others waiting in the first
collective of a save.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pcframe.checkpointer import Checkpointer
from pcframe.distributed import global_versions
from pcframe.distributed.peers import peers
from pcframe.errors import CheckpointError


@dataclass(frozen=True)
class Opened:
    local: Checkpointer  # this rank's engine
    next_version: int  # the next version number, the same on every rank
    retained: list[int]  # the global versions whose records are valid (from rank 0)


def open_shards(
    root: Path, open_local: Callable[[], Checkpointer], control: Any, report: Any
) -> Opened:
    """Open this rank's engine with ``open_local`` and agree with the others (collective).

    On a failure anywhere the engine is closed again, both process groups are destroyed and
    the error is raised on every rank (this rank's own, or one naming the failing rank).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local, mine, error = None, None, ""
    retained, newest_record = [], 0
    try:
        local = open_local()
        if rank == 0:
            global_versions.remove_partial_records(root)
            records, _ = global_versions.valid_records(root)
            retained = sorted(r.version for r in records)
            newest_record = max(global_versions.record_versions(root), default=0)
    except (CheckpointError, OSError, TypeError, ValueError) as exc:
        mine, error = exc, f"{type(exc).__name__}: {exc}"
    top = max(local.next_version, newest_record + 1) if local else 0
    gathered: list[Any] = [None] * world_size
    try:
        with peers("opening the checkpoint"):
            dist.all_gather_object(gathered, (top, retained, error), group=control)
    except CheckpointError as exc:  # a peer is gone: nothing to agree with
        gathered, mine = [(0, [], str(exc))], mine or exc
    failed = [(r, e) for r, (_, _, e) in enumerate(gathered) if e]
    if failed:
        if local is not None:
            local.close()
        dist.destroy_process_group(report)
        dist.destroy_process_group(control)
        if mine is not None:
            raise mine
        other, message = failed[0]
        raise CheckpointError(f"rank {other} could not open its checkpoint shard: {message}")
    assert local is not None
    return Opened(local, max(t for t, _, _ in gathered), gathered[0][1])
