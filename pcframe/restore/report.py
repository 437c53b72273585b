"""``RestoreReport``: what a restore loaded, from where, and what it skipped on the way."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RestoreReport:
    version: int | None = None
    step: int | None = None
    seconds: float = 0.0
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (version, why)
    tier: str | None = None  # the tier the version was read from (None without tiers)
    unavailable: list[str] = field(default_factory=list)  # tiers that could not be listed
    not_loaded: list[str] = field(default_factory=list)  # restore(strict=False): what did not fit
    in_place_bytes: int = 0  # bytes read straight into the live model's (and optimizer's) tensors
    # Of those, read once, straight in (their old bytes kept in the idle staging pool to
    # put back on failure), not verified first and read again from the page cache.
    direct_bytes: int = 0


@dataclass
class DistributedRestoreReport(RestoreReport):
    """A multi-rank restore: ``version`` is the global version, ``skipped`` global versions."""

    saved_world_size: int | None = None
    resharded: bool = False
    per_rank_state_from: int | None = None  # saved rank whose RNG/data position was loaded
    # Where this rank read each shard of the version from (rank -> "local disk", "peer
    # memory", "fetched": brought by this restore, "object store"), what bringing the
    # missing ones cost it, and the versions passed over because a shard was nowhere.
    shard_sources: dict[int, str] = field(default_factory=dict)
    peer_bytes: int = 0  # received from other ranks (their disks or peer memory)
    remote_bytes: int = 0  # downloaded from the object store
    fetch_seconds: float = 0.0
    lost: list[tuple[int, str]] = field(default_factory=list)  # (version, which shard)
