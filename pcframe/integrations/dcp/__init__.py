"""torch.distributed.checkpoint (DCP) storage backed by pcframe's engine and format.

``dcp.save(state, storage_writer=StorageWriter(root))``, ``dcp.async_save(...)`` and
``dcp.load(state, storage_reader=StorageReader(root))`` work unchanged, on one rank or many;
each save becomes one crash-safe, checksummed pcframe version (``pcframe list / verify /
inspect / export`` work on it). See ``docs/integrations.md`` (DCP section).
"""

from pcframe.integrations.dcp.reader import StorageReader
from pcframe.integrations.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
