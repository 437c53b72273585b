"""Where a multi-rank checkpoint's versions go beyond each rank's own disk.

Two tiers outlive a lost node: the **peer tier**, copies of each rank's shard in the memory
of ranks on other nodes (:mod:`pcframe.distributed.replication`), and the **object store**,
where every rank's own engine uploads its shard (``<url>/rank-<r>/``) and rank 0 the records
(``<url>/global/``, :mod:`pcframe.distributed.remote_shards`).

The placement policy of the local engines says which versions go where, as for one process:
a tier named :data:`PEERS` in it is the peer tier (rank 0's answer, asked when a version
becomes global, holds for the whole job), the others are the configured ``tiers``. Without a
placement naming the peer tier, every global version goes to it (when ``replicas`` > 0).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pcframe.distributed.global_versions import rank_dirname
from pcframe.distributed.remote_shards import RemoteShards, rank_url
from pcframe.policies.base import Notice
from pcframe.store.tiers import Tiers

PEERS = "peers"  # the peer tier's name in a placement policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankTiers:
    """One rank's view of the job's tiers."""

    local: dict[str, Any]  # the local engine's replica tiers, each at this rank's own place
    remote: RemoteShards | None  # the object store holding every rank's shards, if any
    remote_name: str | None = None  # the name of ``remote``'s tier among ``local``


def rank_tiers(tiers: Mapping[str, Any] | None, rank: int) -> RankTiers:
    """Each configured tier at rank ``rank``'s own place under it (``<tier>/rank-<r>``); the
    first URL tier is also where the restore looks for every rank's shards and the records.

    Raises:
        ValueError: a tier given as an object (it cannot be split per rank).
    """
    local: dict[str, Any] = {}
    remote: RemoteShards | None = None
    remote_name: str | None = None
    for name, spec in (tiers or {}).items():
        if isinstance(spec, Mapping) and "url" in spec:
            options = dict(spec)
            url = options.pop("url")
            local[name] = {"url": rank_url(url, rank), **options}
            if remote is None:
                remote, remote_name = RemoteShards(url, options), name
        elif isinstance(spec, str | os.PathLike) and "://" in os.fspath(spec):
            url = os.fspath(spec)
            if url.startswith("file://"):
                local[name] = Path(url[len("file://") :]) / rank_dirname(rank)
            else:
                local[name] = rank_url(url, rank)
                if remote is None:
                    remote, remote_name = RemoteShards(url), name
        elif isinstance(spec, str | os.PathLike):
            local[name] = Path(spec) / rank_dirname(rank)
        elif isinstance(spec, Mapping) and set(spec) == {"path"}:
            local[name] = Path(spec["path"]) / rank_dirname(rank)
        else:
            raise ValueError(
                f"tiers.{name}: a multi-rank job needs a path or URL per tier (each rank writes "
                f"its own '{rank_dirname(rank)}' under it), not a {type(spec).__name__}"
            )
    return RankTiers(local, remote, remote_name)


def start_job_listing(job: RankTiers, tiers: Tiers | None) -> Callable[[], int]:
    """The object store listed once for the job while the ranks open: returns a call that
    gives the newest version any rank's shard has there (0 when none, or when it cannot be
    listed: each rank's tier then lists again before it writes, with its warning).

    Rank 0 lists in the background; no rank's engine lists its own object-store tier when it
    opens (:meth:`~pcframe.store.tiers.Tiers.list_later`). Without it, each rank lists its
    own prefix while it opens: one request per rank, and each rank's first request also
    builds its object-store client, CPU time every rank would spend on the way to its first
    step after a restart. The number feeds the ranks' agreement on the next version number
    (:func:`~pcframe.distributed.opening.open_shards`), so a job whose disks are all new
    still numbers above what its object store holds.
    """
    if job.remote is None or job.remote_name is None or tiers is None:
        return lambda: 0
    tiers.list_later(job.remote_name)
    if dist.get_rank() != 0:
        return lambda: 0
    remote = job.remote
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pcframe-job-listing")

    def newest() -> int:
        listing = remote.committed()
        return max((v for versions in listing.values() for v in versions), default=0)

    future = pool.submit(newest)
    pool.shutdown(wait=False)

    def result() -> int:
        try:
            return future.result()
        except Exception as exc:  # numbered from the disks; the tiers list again later
            log.warning("object store not listed while opening: %s", exc)
            return 0

    return result


def peers_due(tiers: Tiers | None, replicas: int) -> Callable[[int, bool], bool] | None:
    """Whether a version just made global goes to the peer tier (rank 0 asks, for the job):
    the placement's answer when it names :data:`PEERS` (asked through ``tiers``, which
    serializes the calls to it), else every version."""
    if replicas == 0:
        return None
    placement = tiers.placement if tiers is not None else None
    if placement is None or PEERS not in placement.tiers:
        return lambda version, emergency: True
    assert tiers is not None

    def due(version: int, emergency: bool) -> bool:
        now = time.monotonic()
        # An emergency's window is the local engine's to know; here: as long as it takes.
        notice = Notice(received_at=now, deadline=math.inf, source="rank") if emergency else None
        return PEERS in tiers.place(version, 0, notice).tiers

    return due
