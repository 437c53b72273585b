"""Which global version a restore loads: the newest that every rank reads and verifies.

Each rank reads and verifies what it needs of the version (:func:`prepare`), then the ranks
exchange one :class:`Verdict` each, so every rank takes the same branch: all ``OK`` loads it,
any ``CORRUPT`` skips it on every rank (the restore tries the previous global version), any
``UNREADABLE`` stops the restore without going back (storage, not corruption: an older
version would silently lose work), and any ``INCOMPATIBLE`` (the state does not fit the
objects, or cannot be resharded) is raised on every rank. The exchange happens even when
this rank failed, so no rank waits in a collective the others left.

:func:`load_newest` is the restore's entry: it walks the records newest first, then applies
the version that verifies with signals held (:mod:`pcframe.runtime.interrupts`).
Once an older version verifies, each version skipped as corrupt is forgotten by the commit
protocol and its record moved aside by rank 0
(:func:`~pcframe.distributed.global_versions.quarantine_record`), so it stops counting as one of the
``keep_global`` retained versions: the next publication keeps the good version the restore
fell back to, not the bad one above it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pcframe.distributed import global_versions
from pcframe.distributed.index import SavedIndex
from pcframe.distributed.peers import peers
from pcframe.distributed.protocol import CommitProtocol
from pcframe.distributed.recovery import Recovery
from pcframe.distributed.restore import Prepared, prepare
from pcframe.errors import (
    CheckpointError,
    ManifestError,
    NoValidCheckpoint,
    ReshardError,
    RestoreIOError,
    UnsupportedCheckpoint,
)
from pcframe.restore.report import DistributedRestoreReport
from pcframe.restore.sources import READ_ATTEMPTS, read_with_retries, stop_at_unsupported
from pcframe.runtime.collector import collect_if_paused, collector_paused
from pcframe.runtime.interrupts import interrupts_held
from pcframe.state.objects import TrainingObjects
from pcframe.store.starts import UNKNOWN_WRITER

log = logging.getLogger("pcframe")

MAX_COPY_RETRIES = 4  # gathers of one version after damaged copies were dropped


class Verdict(Enum):
    OK = "ok"
    CORRUPT = "corrupt"  # a checksum, a manifest or the record itself is wrong: skip it
    UNREADABLE = "unreadable"  # an I/O error that outlasted the retries
    UNSUPPORTED = "unsupported"  # a newer format or an unregistered codec: stop, move nothing
    INCOMPATIBLE = "incompatible"  # the saved state does not fit this job's objects
    COPY_DAMAGED = "copy damaged"  # a peer's or a fetched copy failed, dropped: fetch again


RETRY = "retry"  # try_global_version: a damaged copy was dropped; gather the version again
# A read of a copy failing with these says the copy's files are gone or are not files.
COPY_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP})


def try_global_version(
    root: Path,
    record: global_versions.GlobalRecord,
    objects: TrainingObjects,
    *,
    rank: int,
    world_size: int,
    reshard: bool,
    threads: int,
    group: Any,
    recovery: Recovery,
) -> tuple[Prepared, SavedIndex] | str:
    """Read and verify ``record`` on every rank (collective), each shard where ``recovery``
    made it readable.

    A read that fails in a copy (a peer's, or fetched: :meth:`Recovery.damaged_copies`
    names those a read's error points at) makes the copy damaged, not the version: it is
    dropped once every rank has given its verdict (the ranks of a node read the same
    copies: removed earlier, it would fail another rank's read of it) and :data:`RETRY` is
    returned, so the version is gathered again from another holder. So does damage in a
    shard's own folder when ``recovery`` knows a holder outside that root (a peer's copy,
    the object store): the damaged shard is set aside, its files kept, and fetched again;
    with no other holder the version is corrupt, as without peers.

    Returns:
        ``(prepared, index)`` when every rank verified its part (nothing is loaded yet),
        the reason to skip the version when it is corrupt on some rank, or :data:`RETRY`.

    Raises:
        RestoreIOError: some rank could not read its part; nothing was renamed or deleted.
        UnsupportedCheckpoint: some rank cannot read its part's format or codec; nothing
            was renamed or deleted.
        ReshardError, CheckpointError: the state cannot be laid out for these objects.
    """
    error: BaseException | None = None
    copies: list[Path] = []  # damaged copies this rank read: dropped after the verdicts
    # (verdict, message, exception name, (src, version) of a damaged shard in this root)
    mine: tuple[Verdict, str, str, tuple[int, int] | None] = (Verdict.OK, "", "", None)
    prepared: Prepared | None = None
    try:
        index = SavedIndex(root, record, recovery.locate)
        prepared = read_with_retries(
            lambda: prepare(index, objects, rank, world_size, reshard, threads)
        )
    except UnsupportedCheckpoint as exc:
        mine = (Verdict.UNSUPPORTED, str(exc), type(exc).__name__, None)
    except (ManifestError, OSError) as exc:  # OSError: retried already
        # A damaged copy (in a peer's memory, or fetched) says nothing of the version, nor
        # does a copy whose files are gone or not files (fetched again); any other I/O
        # error is the storage's (EIO, EMFILE): the restore stops, as for a shard's own.
        of_the_copy = isinstance(exc, ManifestError) or exc.errno in COPY_ERRNOS
        copies = recovery.damaged_copies(record, str(exc)) if of_the_copy else []
        local = None
        if copies:
            verdict = Verdict.COPY_DAMAGED
        else:
            verdict = Verdict.CORRUPT if isinstance(exc, ManifestError) else Verdict.UNREADABLE
            if verdict is Verdict.CORRUPT:
                local = recovery.local_damage(record, str(exc))
        mine = (verdict, str(exc), type(exc).__name__, local)
    except Exception as exc:  # every rank must still reach the collective below
        error, mine = exc, (Verdict.INCOMPATIBLE, str(exc), type(exc).__name__, None)
    verdicts: list[Any] = [None] * world_size
    try:
        with peers("restore"):
            dist.all_gather_object(verdicts, mine, group=group)
        outcome = _outcome(root, record, verdicts, error, recovery)
    except BaseException:
        if prepared is not None:
            prepared.release()
        raise
    if outcome is not None:
        if prepared is not None:
            prepared.release()  # another rank's part failed: the version is not applied
        if outcome is RETRY:
            if any(v[0] is Verdict.CORRUPT for v in verdicts):  # the same on every rank
                recovery.refetched.add(record.version)
            if mine[3] is not None:
                recovery.set_aside_local(*mine[3], mine[1])  # every rank has read it by now
        if outcome is RETRY or any(v[0] is Verdict.COPY_DAMAGED for v in verdicts):
            if copies:  # every rank of this node has read them
                recovery.drop_copies(copies)
            # ... and none lists what it holds for the next gather until every damaged copy
            # is gone: a rank that read no damage would list the copy still being deleted.
            with peers("restore: dropping damaged copies"):
                dist.barrier(group=group)
        return outcome
    assert prepared is not None
    return prepared, index


def _outcome(
    root: Path,
    record: global_versions.GlobalRecord,
    verdicts: list[Any],
    error: BaseException | None,
    recovery: Recovery,
) -> str | None:
    """What the ranks' verdicts make of the version: ``None`` when every rank verified its
    part, else the reason to skip it (or ``RETRY``); raises as :func:`try_global_version`."""
    for other, (verdict, message, name, _) in enumerate(verdicts):
        if verdict is Verdict.INCOMPATIBLE:
            if error is not None:
                raise error
            cls = ReshardError if name == "ReshardError" else CheckpointError
            raise cls(f"rank {other}: {message}")
    unsupported = [
        f"rank {r}: {v[1]}" for r, v in enumerate(verdicts) if v[0] is Verdict.UNSUPPORTED
    ]
    if unsupported:
        raise UnsupportedCheckpoint(
            stop_at_unsupported(
                f"global version {record.version}",
                "; ".join(unsupported),
                f"move {global_versions.record_path(root, record.version)} aside to restore an "
                "older version",
            )
        )
    unreadable = [f"rank {r}: {v[1]}" for r, v in enumerate(verdicts) if v[0] is Verdict.UNREADABLE]
    if unreadable:
        raise RestoreIOError(
            f"cannot read global version {record.version}: {'; '.join(unreadable)} "
            f"(after {READ_ATTEMPTS} attempts); nothing was renamed or deleted: fix "
            "the storage and restore again"
        )
    corrupt = [f"rank {r}: {v[1]}" for r, v in enumerate(verdicts) if v[0] is Verdict.CORRUPT]
    # Damage in a root's own shard that a holder outside that root can replace (the same
    # answer on every rank: the holdings were gathered by all) is fetched again, not lost.
    fetchable = all(
        v[3] is not None and recovery.held_elsewhere(v[3][0], v[3][1], r)
        for r, v in enumerate(verdicts)
        if v[0] is Verdict.CORRUPT
    )
    if corrupt and fetchable:
        return RETRY
    if not corrupt and any(v[0] is Verdict.COPY_DAMAGED for v in verdicts):
        return RETRY
    if corrupt:
        return "; ".join(corrupt)
    return None


def _after_apply(
    report: DistributedRestoreReport,
    record: global_versions.GlobalRecord,
    prepared: Prepared,
    index: SavedIndex,
    recovery: Recovery,
    rank: int,
    applied: Callable[[global_versions.GlobalRecord, Any], object],
) -> None:
    """Once this rank applied ``record``: the report, and the caller's bookkeeping."""
    report.version, report.step = record.version, record.step
    report.saved_world_size = record.world_size
    report.resharded = prepared.resharded
    report.in_place_bytes = prepared.in_place_bytes
    report.per_rank_state_from = prepared.per_rank_from
    report.shard_sources = recovery.kinds(record)
    fetched = recovery.report
    report.peer_bytes, report.remote_bytes = fetched.peer_bytes, fetched.remote_bytes
    report.fetch_seconds = fetched.seconds
    shard = index.manifests.get(rank)
    applied(record, shard.engine if shard else UNKNOWN_WRITER)


def _apply_everywhere(
    prepared: Prepared,
    objects: TrainingObjects,
    record: global_versions.GlobalRecord,
    group: Any,
    world_size: int,
    after: Callable[[], None],
) -> None:
    """Apply on this rank and run ``after`` (the report, the caller's bookkeeping: the
    policy's ``Restarted`` among it), then learn whether every rank did (collective): a
    failure the checks could not foresee (a ``load_state_dict`` or a policy of the user's
    raising on one rank) stops every rank, instead of leaving the others to train on into a
    collective that rank never joins."""
    error: BaseException | None = None
    try:
        prepared.apply(objects)
        after()
    except BaseException as exc:  # SystemExit too: this rank must still reach the gather
        error = exc
    outcomes: list[Any] = [None] * world_size
    mine = None if error is None else f"{type(error).__name__}: {error}".split("\n")[0]
    with peers("restore: applying"):
        dist.all_gather_object(outcomes, mine, group=group)
    if error is not None:
        raise error
    failed = [(r, why) for r, why in enumerate(outcomes) if why is not None]
    if failed:
        other, why = failed[0]
        raise CheckpointError(
            f"rank {other} could not load global version {record.version} ({why}); every "
            "rank stops, this one holding that version: fix the cause and restore again"
        )


def load_newest(
    applied: Callable[[global_versions.GlobalRecord, Any], object],
    root: Path,
    records: Sequence[global_versions.GlobalRecord],
    objects: TrainingObjects,
    report: DistributedRestoreReport,
    protocol: CommitProtocol,
    recovery: Recovery,
    *,
    rank: int,
    world_size: int,
    reshard: bool,
    threads: int,
    group: Any,
) -> global_versions.GlobalRecord | None:
    """Load the newest of ``records`` (newest first) that verifies on every rank into
    ``objects`` (collective); fill ``report``; return its record (``None`` when there are no
    records).

    Versions corrupt on some rank are listed in ``report.skipped``; once an older one
    verifies, they are forgotten by ``protocol`` and their records moved aside (``GLOBAL``
    then names the version chosen); when none verifies nothing is moved.

    ``applied(record, written)``, the caller's bookkeeping, is called once the version is
    applied (``written``: the ``engine`` section of this rank's shard manifest, its writer;
    unknown after a resize). The cyclic collector is held off as in a single-process
    restore (:mod:`pcframe.runtime.collector`), and signals from the apply to the end of
    ``applied`` (:mod:`pcframe.runtime.interrupts`).

    Raises:
        NoValidCheckpoint: records exist but none verifies.
        and as :func:`try_global_version` does.
    """
    skipped: list[int] = []
    with collector_paused():
        for record in records:  # newest first
            if skipped:
                collect_if_paused()  # the failed attempt's tensors, held in a cycle by its error
            for _ in range(MAX_COPY_RETRIES):
                lost = recovery.gather_version(record)
                if lost:
                    break
                outcome = try_global_version(
                    root,
                    record,
                    objects,
                    rank=rank,
                    world_size=world_size,
                    reshard=reshard,
                    threads=threads,
                    group=group,
                    recovery=recovery,
                )
                if outcome is not RETRY:
                    break
                log.warning(
                    "global version %d: a damaged copy was dropped; fetching it again",
                    record.version,
                )
            else:
                lost = "every copy of a shard failed its checksums"
            if lost and record.version in recovery.refetched:
                # A shard damaged in its root and set aside, no good copy anywhere after all:
                # the version is corrupt (set aside once an older one loads), not out of reach.
                outcome = f"a damaged shard could not be had again: {lost}"
                lost = ""
            if lost:
                report.lost.append((record.version, lost))
                log.warning("passing over global version %d: %s", record.version, lost)
                continue
            if isinstance(outcome, str):
                report.skipped.append((record.version, outcome))
                log.warning("skipping global version %d: %s", record.version, outcome)
                skipped.append(record.version)
                continue
            prepared, index = outcome
            try:  # its files (kept for the fill) are let go whatever happens (apply: too)
                # Only once an older version verified: when none does (a root not mounted on
                # this node reads as "manifest missing" everywhere), every record stays.
                reasons = dict(report.skipped)
                for version in skipped:  # every root's copy of the record (one leader each)
                    protocol.forget(version)
                    if recovery.leader:
                        global_versions.quarantine_record(root, version, reasons.get(version, ""))
                if skipped and recovery.leader:  # GLOBAL named a version just set aside
                    with contextlib.suppress(OSError):
                        global_versions.write_pointer(root, record.version)
            except BaseException:
                prepared.release()
                raise

            after = functools.partial(
                _after_apply, report, record, prepared, index, recovery, rank, applied
            )
            with interrupts_held():  # past the point of no return
                _apply_everywhere(prepared, objects, record, group, world_size, after)
            return record
    if report.skipped or report.lost:
        reasons = "; ".join(f"v{v}: {why}" for v, why in [*report.skipped, *report.lost])
        raise NoValidCheckpoint(f"no valid global checkpoint in {root}: {reasons}")
    return None
