"""``load()``: restore from a checkpoint directory without writing to it (read-only media).

The :class:`~pcframe.Checkpointer` takes the directory's writer lock, cleans leftovers and
quarantines damaged versions, so it needs a writable directory. ``load`` only reads: the
same verification, fallback to older versions and all-or-nothing apply, but a damaged
version is skipped, never renamed, and nothing is created, locked or deleted.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

import torch

from pcframe.errors import CheckpointError
from pcframe.objects import Stateful, TrainingObjects
from pcframe.restore.report import RestoreReport
from pcframe.restore.restorer import load_and_apply
from pcframe.store.directory import CheckpointDir
from pcframe.store.tiers import Source


def load(
    directory: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    data: Stateful | None = None,
    stateful: Mapping[str, Stateful] | None = None,
    extra: dict[str, Any] | None = None,
    version: int | None = None,
    strict: bool = True,
    allow_cast: bool = False,
    threads: int = 8,
) -> RestoreReport:
    """Load the newest valid version (or ``version``) of ``directory`` into the objects.

    Returns the :class:`RestoreReport` (``report.step`` is ``None`` when the directory holds
    no checkpoint). The objects are those a :class:`~pcframe.Checkpointer` takes; RNG
    states are restored too. Without a ``policy`` the saved policy state is ignored.

    Raises:
        NoValidCheckpoint, RestoreIOError, CheckpointError: as ``Checkpointer.restore``.
    """
    objects = TrainingObjects.given(model, optimizer, scheduler, scaler, data, stateful, extra)
    root = CheckpointDir(directory)
    if not root.root.is_dir():
        raise CheckpointError(f"{root.root} is not a directory: give a checkpoint directory")
    versions = [v for v in reversed(root.committed_versions()) if version in (None, v)]
    if version is not None and not versions:
        raise CheckpointError(
            f"version {version} is not committed in {root.root}; "
            f"committed: {root.committed_versions()}"
        )
    sources = [
        Source(v, "", lambda v=v: contextlib.nullcontext(root.path(v)), lambda: None)
        for v in versions
    ]
    report = RestoreReport()
    load_and_apply(
        sources,
        objects,
        report,
        threads=threads,
        strict=strict,
        allow_cast=allow_cast,
        root=root.root,
    )
    return report
