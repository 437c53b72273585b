"""The lines the Lightning callback writes, and the names its versions use."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl

# What a default Lightning setup shows: Lightning gives its "lightning.pytorch" logger a
# stream handler at INFO, and this child logger propagates to it (pcframe's own logger has
# no handler of its own, so a WARNING there is only Python's last-resort stderr line).
say = logging.getLogger("lightning.pytorch.callbacks.pcframe")

OWNER = "PcframeCheckpoint"
SECTION = "lightning"  # the stateful name of Lightning's own state in every version
DATA = "pcframe"  # pcframe's entry in that section: the shape of the train data, per loader
AGAIN = "run trainer.fit(...) again"  # what resumes from the last committed version
# How a fit gets back the dtype its versions were saved in (``{}``): its precision.
DTYPE_FIX = "train in the precision it was saved with (the model in {})"


def tell(trainer: pl.Trainer, level: int, message: str) -> None:
    """A line on Lightning's own logger, from rank 0 only (every rank restores the same)."""
    if trainer.is_global_zero:
        say.log(level, message)


def error_line(error: Any) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def n_processes(count: int) -> str:
    return "1 process" if count == 1 else f"{count} processes"
