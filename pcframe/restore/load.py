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

from pcframe.errors import CheckpointError, NoValidCheckpoint, RestoreIOError
from pcframe.format.names import check_requested_version
from pcframe.objects import Stateful, TrainingObjects
from pcframe.restore.report import RestoreReport
from pcframe.restore.restorer import load_and_apply
from pcframe.store.directory import CheckpointDir
from pcframe.store.tiers import Source

LISTINGS = 3  # walks of a directory whose writer keeps committing while this reads it


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
    check_requested_version(version, "load(version=...)")
    objects = TrainingObjects.given(model, optimizer, scheduler, scaler, data, stateful, extra)
    root = CheckpointDir(directory)
    if not root.root.is_dir():
        raise CheckpointError(f"{root.root} is not a directory: give a checkpoint directory")
    listed = root.committed_versions()
    for attempt in range(LISTINGS):
        versions = [v for v in reversed(listed) if version in (None, v)]
        if version is not None and not versions:
            raise CheckpointError(
                f"version {version} is not committed in {root.root}; committed: {listed}"
            )
        report = RestoreReport()
        try:
            load_and_apply(
                _sources(root, versions),
                objects,
                report,
                threads=threads,
                strict=strict,
                allow_cast=allow_cast,
                root=root.root,
            )
            return report
        except (NoValidCheckpoint, RestoreIOError):
            # A writer still at work can commit a newer version and delete (by its
            # retention) the ones this listing named while they are read: list again.
            # Only a listing with a version not tried yet earns another walk.
            before, listed = set(listed), root.committed_versions()
            if version is not None or attempt == LISTINGS - 1 or set(listed) <= before:
                raise
    raise AssertionError("unreachable")


def _sources(root: CheckpointDir, versions: list[int]) -> list[Source]:
    return [
        Source(v, "", lambda v=v: contextlib.nullcontext(root.path(v)), lambda: None)
        for v in versions
    ]
