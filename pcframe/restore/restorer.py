"""One restore: the first source that verifies, checked against and applied to the objects."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from pcframe.collector import collector_paused
from pcframe.errors import NoValidCheckpoint
from pcframe.format.manifest import Manifest
from pcframe.format.names import version_name
from pcframe.interrupts import interrupts_held
from pcframe.objects import TrainingObjects
from pcframe.restore.apply import apply_tree
from pcframe.restore.backup import Spare
from pcframe.restore.check_optimizer import prefetch_fresh_state
from pcframe.restore.in_place import in_place_targets, seen_elsewhere
from pcframe.restore.reader import LoadedVersion
from pcframe.restore.report import RestoreReport
from pcframe.restore.sources import load_first_valid, restore_sources
from pcframe.save.staging import StagingPool
from pcframe.store.directory import quarantined_versions
from pcframe.store.tiers import Source, Tiers

log = logging.getLogger("pcframe")


def restore_from_tiers(
    tiers: Tiers,
    version: int | None,
    objects: TrainingObjects,
    report: RestoreReport,
    pool: StagingPool,
    seen: Callable[[int], None],
    applied: Callable[[Manifest], object],
    *,
    threads: int,
    strict: bool,
    allow_cast: bool,
    root: Path,
) -> Manifest | None:
    """A checkpointer's restore: the newest valid version the tiers hold (or ``version``)
    loaded into ``objects`` (:func:`load_and_apply`), its idle staging ``pool`` lent as
    spare memory. ``seen`` is called with the newest version number any tier holds, valid
    or not, before anything is read, and with the version loaded (new versions are numbered
    above both); ``applied(manifest)`` once the version holds."""
    sources = restore_sources(tiers, version, report)
    if sources:
        seen(sources[0].version)

    def holds(manifest: Manifest) -> None:
        seen(manifest.version)
        applied(manifest)

    with pool.lend() as buffers:
        manifest = load_and_apply(
            sources,
            objects,
            report,
            threads=threads,
            strict=strict,
            allow_cast=allow_cast,
            root=root,
            spare=Spare(buffers, staged=pool.holding(buffers), written=pool.forget),
            applied=holds,
        )
    return manifest


def load_and_apply(
    sources: list[Source],
    objects: TrainingObjects,
    report: RestoreReport,
    *,
    threads: int,
    strict: bool,
    allow_cast: bool,
    root: Path,
    spare: Spare | None = None,
    applied: Callable[[Manifest], object] | None = None,
) -> Manifest | None:
    """Load the newest valid source into ``objects``; fill ``report``; return its manifest.

    ``applied(manifest)``: called once the version is applied, before an interrupt held
    during the commit is raised (the caller's bookkeeping of a restore that holds).

    ``spare``: host buffers free while this runs (the checkpointer's idle staging pool), where
    the live tensors' old bytes are kept so that the version is read straight into them
    (:mod:`pcframe.restore.backup`), and the raw chunks they still hold from the saves,
    copied instead of read where they verify (:mod:`pcframe.restore.staged`). Whatever ends
    this call by an exception (an interrupt between the read and the apply included), bytes
    read over and not committed go back.

    Returns ``None`` when there is no checkpoint at all.

    Raises:
        NoValidCheckpoint: every committed version failed verification.
        RestoreIOError: the newest version cannot be read (I/O errors after retries).
        CheckpointError: the version does not fit the objects (nothing was changed).
    """
    start = time.perf_counter()
    with collector_paused():  # no full collections among the restore's short-lived objects
        targets = in_place_targets(objects.model, objects.optimizer)
        lent = spare or Spare()
        lent.shared = seen_elsewhere(targets, objects.model, objects.optimizer)
        try:
            loaded = _first_valid(sources, objects, report, targets, lent, threads, root)
            if loaded is None:
                return None
            # The commit: once a byte is filled a second time there is no way back, so an
            # interrupt waits until the restore is complete (pcframe.interrupts).
            with interrupts_held():
                manifest = _commit(loaded, objects, report, strict, allow_cast)
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
    objects: TrainingObjects,
    report: RestoreReport,
    targets: dict[str, torch.Tensor],
    spare: Spare,
    threads: int,
    root: Path,
) -> LoadedVersion | None:
    """The newest source that reads and verifies (None: there is no checkpoint at all)."""
    finding = prefetch_fresh_state(objects.optimizer)  # while the bytes are read
    try:
        loaded = load_first_valid(sources, threads, report, targets=targets, spare=spare)
    finally:
        if finding is not None:
            finding.join()
    if loaded is None:
        if report.skipped:
            reasons = "; ".join(f"v{v}: {why}" for v, why in report.skipped)
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
        log.info("no checkpoint in %s: training starts from the beginning", root)
    return loaded


def _commit(
    loaded: LoadedVersion,
    objects: TrainingObjects,
    report: RestoreReport,
    strict: bool,
    allow_cast: bool,
) -> Manifest:
    """Check the verified version against the objects and apply it (filling in place)."""
    manifest = loaded.manifest
    where = f"version {manifest.version} ({version_name(manifest.version)})"

    def fill(sections: Collection[str]) -> int:
        report.in_place_bytes = loaded.fill(sections)
        return report.in_place_bytes

    try:
        report.not_loaded = apply_tree(
            objects,
            loaded.state_tree(),
            where,
            strict=strict,
            allow_cast=allow_cast,
            fill=fill if loaded.in_place_bytes else None,
            unfill=loaded.in_place.unfill,
        )
    finally:
        loaded.release()
    report.version, report.step = manifest.version, manifest.step
    report.direct_bytes = loaded.in_place.direct_bytes
    return manifest
