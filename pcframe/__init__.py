"""pcframe: concurrent, crash-safe, persistent checkpointing for ML training."""

from pcframe.checkpointer import Checkpointer, RestoreReport, SaveHandle, SaveRecord
from pcframe.config import EngineConfig
from pcframe.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpoint,
    DirectoryLocked,
    ManifestError,
    NoValidCheckpoint,
    RestoreIOError,
    SaveError,
    UnsupportedCheckpoint,
)
from pcframe.restore.restorer import load
from pcframe.state.data import ResumableLoader, ResumableSampler

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "ConfigError",
    "CorruptCheckpoint",
    "DirectoryLocked",
    "EngineConfig",
    "ManifestError",
    "NoValidCheckpoint",
    "RestoreIOError",
    "RestoreReport",
    "ResumableLoader",
    "ResumableSampler",
    "SaveError",
    "SaveHandle",
    "SaveRecord",
    "UnsupportedCheckpoint",
    "load",
]
