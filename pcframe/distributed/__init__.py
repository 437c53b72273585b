"""Multi-rank checkpointing: per-rank shards, a global commit by rank 0, resharding restore.

See ``docs/distributed.md``. The entry point is :class:`DistributedCheckpointer`.
"""

from pcframe.distributed.checkpointer import DistributedCheckpointer
from pcframe.distributed.global_versions import GlobalRecord, ShardRef, read_record, valid_records
from pcframe.distributed.handle import DistributedSaveHandle
from pcframe.errors import RanksOutOfStep, ReshardError
from pcframe.restore.report import DistributedRestoreReport

__all__ = [
    "DistributedCheckpointer",
    "DistributedRestoreReport",
    "DistributedSaveHandle",
    "GlobalRecord",
    "RanksOutOfStep",
    "ReshardError",
    "ShardRef",
    "read_record",
    "valid_records",
]
