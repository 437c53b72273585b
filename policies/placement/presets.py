"""The shipped placement policies: presets of :class:`TieredPlacement` with named arguments."""

from __future__ import annotations

from pcframe.policies.placement.tiered import TieredPlacement, TierRule
from pcframe.policies.registry import register


@register()
class SingleTier(TieredPlacement):
    """Every version to one tier (local disk by default), keeping the newest ``keep``."""

    name = "single_tier"

    def __init__(self, tier: str = "local", keep: int = 2, margin: float = 5.0) -> None:
        super().__init__([TierRule(tier, 1, keep, True)], margin)


@register()
class MemoryThenDisk(TieredPlacement):
    """Every version to a memory tier (tmpfs, /dev/shm) first, every ``disk_every``-th also
    to local disk. Memory survives a crash of the process but not the loss of the VM.

    Args:
        memory_tier, disk_tier: tier names as configured in the engine.
        memory_keep, disk_keep: versions kept per tier.
        disk_every: write every n-th version to disk too (1 = write-through).
        disk_survives_preemption: false for instance-store disks that vanish with the VM.
    """

    name = "memory_then_disk"

    def __init__(
        self,
        memory_tier: str = "memory",
        disk_tier: str = "local",
        memory_keep: int = 1,
        disk_keep: int = 2,
        disk_every: int = 1,
        disk_survives_preemption: bool = True,
        margin: float = 5.0,
    ) -> None:
        super().__init__(
            [
                TierRule(memory_tier, 1, memory_keep, survives_preemption=False),
                TierRule(disk_tier, disk_every, disk_keep, disk_survives_preemption),
            ],
            margin,
        )


@register()
class LocalPlusRemote(TieredPlacement):
    """Every version to local disk, every ``remote_every``-th also uploaded to a remote tier
    (an fsspec URL configured in the engine, e.g. ``s3://bucket/run``).

    Args:
        local_tier, remote_tier: tier names.
        remote_every: upload every k-th version.
        local_keep, remote_keep: versions kept per tier.
        local_survives_preemption: false for instance-store disks.
    """

    name = "local_plus_remote"

    def __init__(
        self,
        local_tier: str = "local",
        remote_tier: str = "remote",
        remote_every: int = 5,
        local_keep: int = 2,
        remote_keep: int = 3,
        local_survives_preemption: bool = False,
        margin: float = 5.0,
    ) -> None:
        super().__init__(
            [
                TierRule(local_tier, 1, local_keep, local_survives_preemption),
                TierRule(remote_tier, remote_every, remote_keep, True),
            ],
            margin,
        )
