"""pcframe: concurrent, crash-safe, persistent checkpointing for ML training."""

__version__ = "0.1.0"
