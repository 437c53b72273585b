"""Storage tiers: memory (tmpfs), local disk and remote (fsspec) replicas of checkpoints.

The Checkpointer's own directory is the primary tier; :class:`Tiers` adds replicas filled in
the background from committed versions, per-tier retention from a placement policy, restores
across tiers, and the emergency path for preemption notices. See ``docs/tiers.md``.
"""

from pcframe.errors import TierCancelled, TierError
from pcframe.store.tiers.base import Tier
from pcframe.store.tiers.local import LocalTier
from pcframe.store.tiers.memory import is_memory_backed, memory_directory
from pcframe.store.tiers.replicator import Replicator, TierStatus
from pcframe.store.tiers.specs import make_tier
from pcframe.store.tiers.tierset import Secured, Source, Tiers, attach_tiers


def __getattr__(name: str) -> object:
    # RemoteTier imports fsspec; load it only when asked for.
    if name == "RemoteTier":
        from pcframe.store.tiers.remote import RemoteTier

        return RemoteTier
    raise AttributeError(f"module 'pcframe.store.tiers' has no attribute {name!r}")


__all__ = [
    "LocalTier",
    "RemoteTier",
    "Replicator",
    "Secured",
    "Source",
    "Tier",
    "TierCancelled",
    "TierError",
    "TierStatus",
    "Tiers",
    "attach_tiers",
    "is_memory_backed",
    "make_tier",
    "memory_directory",
]
