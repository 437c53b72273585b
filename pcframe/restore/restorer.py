"""One restore: the first source that verifies, checked against and applied to the objects.

Both ways in share :func:`load_and_apply`: a :class:`~pcframe.Checkpointer`'s restore
(:func:`restore_from_tiers`: its tiers, its idle staging pool lent as spare memory) and
:func:`load`, which restores from a directory without writing to it (read-only media). The
Checkpointer takes the directory's writer lock, cleans leftovers and quarantines damaged
versions, so it needs a writable directory; ``load`` only reads: the same verification,
fallback to older versions and all-or-nothing apply, but a damaged version is skipped,
never renamed, and nothing is created, locked or deleted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pcframe.config import MAX_THREADS
from pcframe.errors import (
    CheckpointError,
    NoValidCheckpoint,
    RestoreIOError,
    UnsupportedCheckpoint,
)
from pcframe.format.manifest import DCP_SECTION, Manifest
from pcframe.format.names import RANK_DIR, check_requested_version, version_name
from pcframe.restore.live import Spare
from pcframe.restore.reader import LoadedVersion
from pcframe.restore.report import RestoreReport
from pcframe.restore.sources import load_first_valid, restore_sources, stop_at_unsupported
from pcframe.runtime.checks import whole_number
from pcframe.runtime.collector import collector_paused
from pcframe.runtime.interrupts import interrupts_held
from pcframe.save.staging import StagingPool
from pcframe.state.apply import apply_tree
from pcframe.state.check import LoadRules
from pcframe.state.in_place import in_place_targets, seen_elsewhere
from pcframe.state.objects import Stateful, TrainingObjects
from pcframe.state.optimizer import prefetch_fresh_state
from pcframe.store.directory import CheckpointDir, quarantined_versions, refuse_version_folder
from pcframe.store.tiers import Source, Tiers

log = logging.getLogger("pcframe")

LISTINGS = 3  # walks of a directory whose writer keeps committing while load() reads it


@dataclass
class RestoreJob:
    """What one restore loads into and how: the objects, the rules for a version that does
    not fit them, the reading threads, the directory it is named by in messages, the
    report it fills, and the version asked for (``None``: the newest valid one)."""

    objects: TrainingObjects
    rules: LoadRules
    threads: int
    root: Path
    report: RestoreReport
    version: int | None = None


def load_rules(call: str, strict: object, allow_cast: object) -> LoadRules:
    """The rules of ``call`` (``"restore"``, ``"load"``), its flags checked: a string such as
    ``"no"`` is truthy, so ``allow_cast="no"`` would cast and ``strict="False"`` be strict.

    Raises:
        TypeError: a flag is not a bool, naming it and the call.
    """
    for name, flag in (("strict", strict), ("allow_cast", allow_cast)):
        if not isinstance(flag, bool):
            raise TypeError(f"{call}({name}={flag!r}): give True or False")
    return LoadRules(strict=bool(strict), allow_cast=bool(allow_cast))


def check_read_threads(call: str, threads: object) -> None:
    """Refuse reader ``threads`` outside the engine's ``read_threads`` range
    (1..:data:`~pcframe.config.MAX_THREADS`), naming ``call``: a string failed deep in the
    reader as a raw comparison error, and 10**6 started a thread per chunk.

    Raises:
        TypeError: not a whole number in that range.
    """
    if not whole_number(threads) or not 1 <= threads <= MAX_THREADS:
        raise TypeError(
            f"{call}(threads={threads!r}): give 1..{MAX_THREADS} reader threads, e.g. 8"
        )


def restore_from_tiers(
    tiers: Tiers,
    version: int | None,
    job: RestoreJob,
    pool: StagingPool,
    seen: Callable[[int], None],
    applied: Callable[[Manifest], object],
) -> Manifest | None:
    """A checkpointer's restore: the newest valid version the tiers hold (or ``version``)
    loaded as ``job`` says (:func:`load_and_apply`), its idle staging ``pool`` lent as
    spare memory. ``seen`` is called with the newest version number any tier holds, valid
    or not, before anything is read, and with the version loaded (new versions are numbered
    above both); ``applied(manifest)`` once the version holds."""

    def holds(manifest: Manifest) -> None:
        seen(manifest.version)
        applied(manifest)

    tried: set[int] = set()
    sources = restore_sources(tiers, version, job.report)
    for attempt in range(LISTINGS):
        if sources:
            seen(sources[0].version)
        try:
            with pool.lend() as buffers:
                spare = Spare(buffers, staged=pool.holding(buffers), written=pool.forget)
                return load_and_apply(sources, job, spare, holds)
        except (NoValidCheckpoint, RestoreIOError) as failure:
            # A tier another process writes (an object store whose job keeps uploading and
            # pruning) can commit a newer version and delete the ones listed here while they
            # are read: as load() does, list again, and walk again only for a version not
            # tried yet (never back to an older one).
            tried |= {s.version for s in sources}
            if version is not None or attempt == LISTINGS - 1:
                raise
            try:
                sources = restore_sources(tiers, version, RestoreReport())
            except RestoreIOError:  # every tier out of reach now: the failure stands
                raise failure from None
            if not sources or sources[0].version <= max(tried):
                raise
    raise AssertionError("unreachable")


def load_and_apply(
    sources: list[Source],
    job: RestoreJob,
    spare: Spare | None = None,
    applied: Callable[[Manifest], object] | None = None,
) -> Manifest | None:
    """Load the newest valid source into ``job.objects``; fill ``job.report``; return its
    manifest (``None`` when there is no checkpoint at all).

    ``applied(manifest)``: called once the version is applied, before an interrupt held
    during the commit is raised (the caller's bookkeeping of a restore that holds).

    ``spare``: host buffers free while this runs (the checkpointer's idle staging pool), where
    the live tensors' old bytes are kept so that the version is read straight into them
    (:mod:`pcframe.restore.live`), and the raw chunks they still hold from the saves,
    copied instead of read where they verify (:mod:`pcframe.restore.staged`). Whatever ends
    this call by an exception (an interrupt between the read and the apply included), bytes
    read over and not committed go back.

    Raises:
        NoValidCheckpoint: every committed version failed verification.
        RestoreIOError: the newest version cannot be read (I/O errors after retries).
        CheckpointError: the version does not fit the objects (nothing was changed).
    """
    start, objects, report = time.perf_counter(), job.objects, job.report
    with collector_paused():  # no full collections among the restore's short-lived objects
        targets = in_place_targets(objects.model, objects.optimizer)
        lent = spare or Spare()
        lent.shared = seen_elsewhere(targets, objects.model, objects.optimizer)
        finding = prefetch_fresh_state(objects.optimizer)  # on a thread, while bytes are read
        try:
            loaded = _first_valid(sources, job, targets, lent, finding)
            if loaded is None:
                return None
            # The commit: once a byte is filled a second time there is no way back, so an
            # interrupt waits until the restore is complete (pcframe.runtime.interrupts).
            with interrupts_held():
                manifest = _commit(loaded, job)
                report.seconds = time.perf_counter() - start
                log.info(
                    "restored version %d (step %d) in %.2f s%s%s",
                    manifest.version,
                    manifest.step,
                    report.seconds,
                    f" from tier {report.tier}" if report.tier else "",
                    f", after skipping {len(report.skipped)} damaged version(s)"
                    if report.skipped
                    else "",
                )
                if applied is not None:
                    applied(manifest)
        except BaseException:
            lent.put_back_unsettled()  # every reading thread has ended (the reader waits)
            raise
    return manifest


def _first_valid(
    sources: list[Source],
    job: RestoreJob,
    targets: dict[str, torch.Tensor],
    spare: Spare,
    finding: threading.Thread | None,
) -> LoadedVersion | None:
    """The newest source that reads and verifies (None: there is no checkpoint at all);
    ``finding`` (the optimizer's fresh state being worked out) is joined either way."""
    report, root = job.report, job.root
    try:
        loaded = load_first_valid(sources, job.threads, report, targets=targets, spare=spare)
    finally:
        if finding is not None:
            finding.join()
    if loaded is None:
        if report.skipped:
            reasons = "; ".join(f"v{v}: {why}" for v, why in report.skipped)
            if job.version is not None:  # older or newer versions may well be valid
                reasons = "; ".join(why for _, why in report.skipped)
                raise NoValidCheckpoint(
                    f"version {job.version} in {root} is damaged ({reasons}): ask for another "
                    "version, or for none to load the newest valid one"
                )
            raise NoValidCheckpoint(f"no valid checkpoint in {root}: {reasons}")
        set_aside = quarantined_versions(root)
        if set_aside:
            # An earlier restore quarantined every version (and raised): starting from step 0
            # now, silently, would drop their work if the damage was a false alarm.
            raise NoValidCheckpoint(
                f"no valid checkpoint in {root}: every version left was set aside as damaged "
                f"by an earlier restore ({', '.join(set_aside)}; `pcframe list` names them); "
                "to start from the beginning on purpose, move or delete them"
            )
        ranks = _rank_folders(root)
        if ranks:
            # The versions are in the rank folders, none at the top: "no checkpoint" would
            # start a run over from step 0 beside them, or evaluate a fresh model.
            shown = ", ".join(ranks[:3]) + (", ..." if len(ranks) > 3 else "")
            raise CheckpointError(
                f"{root} holds the checkpoints of a multi-rank job ({shown}), which one "
                "process's Checkpointer or pcframe.load cannot read: restore them with "
                "pcframe.distributed.DistributedCheckpointer under torchrun (one process: "
                "--nproc-per-node 1; it reshards), or dcp.load with "
                "pcframe.integrations.dcp.StorageReader where dcp.save wrote them; or give "
                "this run its own directory"
            )
        log.info("no checkpoint in %s: training starts from the beginning", root)
    return loaded


def _rank_folders(root: Path) -> list[str]:
    """The ``rank-<r>`` folders of ``root`` (links not followed), by rank."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    folders = [
        (int(match.group(1)), entry.name)
        for entry in entries
        if (match := RANK_DIR.match(entry.name)) and entry.is_dir(follow_symlinks=False)
    ]
    return [name for _, name in sorted(folders)]


@dataclass
class _FillInto:
    """The apply's in-place fill of one loaded version, its bytes counted in the report."""

    loaded: LoadedVersion
    report: RestoreReport

    def fill(self, sections: Collection[str]) -> int:
        self.report.in_place_bytes = self.loaded.fill(sections)
        return self.report.in_place_bytes

    def unfill(self) -> bool:
        return self.loaded.in_place.unfill()


def _commit(loaded: LoadedVersion, job: RestoreJob) -> Manifest:
    """Check the verified version against the objects and apply it (filling in place)."""
    manifest, report = loaded.manifest, job.report
    where = f"version {manifest.version} ({version_name(manifest.version)})"
    fill = _FillInto(loaded, report) if loaded.in_place_bytes else None
    try:
        if isinstance(manifest.tree, dict) and DCP_SECTION in manifest.tree:
            # dcp.save's items, not the objects' sections: checked against the objects it
            # fits none of them, and strict=False would return its step, having loaded nothing.
            raise CheckpointError(
                f"{where} in {job.root} was written by torch DCP (pcframe.integrations.dcp."
                "StorageWriter): load it with dcp.load(state, storage_reader=pcframe."
                f"integrations.dcp.StorageReader({str(job.root)!r})); nothing was loaded"
            )
        try:
            tree = loaded.state_tree()
        except UnsupportedCheckpoint as exc:  # a class it names is not in this process
            raise UnsupportedCheckpoint(stop_at_unsupported(where, exc)) from None
        report.not_loaded = apply_tree(job.objects, tree, where, job.rules, fill)
    finally:
        loaded.release()
    report.version, report.step = manifest.version, manifest.step
    report.direct_bytes = loaded.in_place.direct_bytes
    return manifest


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
    """Load the newest valid version (or ``version``) of ``directory`` into the objects,
    writing nothing to it.

    Returns the :class:`RestoreReport` (``report.step`` is ``None`` when the directory holds
    no checkpoint). The objects are those a :class:`~pcframe.Checkpointer` takes; RNG
    states are restored too. Without a ``policy`` the saved policy state is ignored.

    Raises:
        NoValidCheckpoint, RestoreIOError, CheckpointError: as ``Checkpointer.restore``.
        TypeError: ``strict`` or ``allow_cast`` is not a bool, ``threads`` not 1..256.
    """
    check_requested_version(version, "load(version=...)")
    rules = load_rules("load", strict, allow_cast)
    check_read_threads("load", threads)
    objects = TrainingObjects.given(model, optimizer, scheduler, scaler, data, stateful, extra)
    root = CheckpointDir(directory)
    if not root.root.is_dir():
        raise CheckpointError(f"{root.root} is not a directory: give a checkpoint directory")
    refuse_version_folder(root.root, "load(version={}) picks this one")
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
                _read_only_sources(root, versions),
                RestoreJob(objects, rules, threads, root.root, report, version),
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


def _read_only_sources(root: CheckpointDir, versions: list[int]) -> list[Source]:
    return [
        Source(v, "", lambda v=v: contextlib.nullcontext(root.path(v)), lambda _: None)
        for v in versions
    ]
