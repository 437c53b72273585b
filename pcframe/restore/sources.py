"""Where a restore reads from, and the newest-first walk that falls back on corruption.

Three kinds of failure are told apart, because only one of them says anything against the
checkpoint:

* **corruption** (a checksum or structure mismatch of bytes actually read, a missing or
  non-regular file: :class:`~pcframe.errors.ManifestError`): the version is quarantined
  (renamed ``.corrupt-*``, kept for inspection) and the next older one is tried;
* an **I/O error** (``OSError``: EIO, EMFILE, ENOMEM, a network tier timing out): the read is
  retried with backoff; if it keeps failing, the same version is tried from the next tier
  that holds it, and if none can be read, restore raises
  :class:`~pcframe.errors.RestoreIOError` naming the file and errno. Nothing is renamed, and
  restore never silently goes back to an older version because storage hiccuped;
* a version this pcframe **cannot read but another may** (a newer format version, a codec
  not registered in this process: :class:`~pcframe.errors.UnsupportedCheckpoint`): restore
  stops with an error naming the version and the fix, and renames nothing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import TypeVar

import torch

from pcframe.errors import (
    CheckpointError,
    ManifestError,
    RestoreIOError,
    UnsupportedCheckpoint,
    out_of_memory,
)
from pcframe.format.names import check_requested_version
from pcframe.restore.live import Spare
from pcframe.restore.reader import LoadedVersion, load_version
from pcframe.restore.report import RestoreReport
from pcframe.runtime.collector import collect_if_paused
from pcframe.store.tiers import Source, TierError, Tiers

log = logging.getLogger("pcframe")
T = TypeVar("T")

READ_ATTEMPTS = 4  # per source: the first read and three retries
BACKOFF = 0.05  # seconds before the first retry; doubled each time (0.05, 0.1, 0.2)


def restore_sources(tiers: Tiers, version: int | None, report: RestoreReport) -> list[Source]:
    """Every place holding a committed version, newest first (only ``version`` if given).

    With replica tiers each version is offered tier by tier (primary, local, remote); tiers
    that cannot be listed are recorded in ``report.unavailable``.

    Raises:
        TypeError: ``version`` is not an int (nothing is read).
        CheckpointError: ``version`` was asked for and is committed nowhere.
        RestoreIOError: no tier that could be listed holds a version, and some tier could not
            be listed: it may hold the job's checkpoints (a new machine whose remote is down),
            so "no checkpoint" would restart the job from step 0 and let its saves push the
            old versions out of that tier.
    """
    check_requested_version(version)
    sources, report.unavailable = tiers.sources(version)
    for reason in report.unavailable:
        log.warning("restore cannot see tier %s", reason)
    if not sources and report.unavailable:
        raise RestoreIOError(
            "cannot tell whether a checkpoint exists: no tier that could be listed holds one, "
            f"and {'; '.join(report.unavailable)}; nothing was renamed or deleted: fix the "
            "storage and restore again (to start from step 0 on purpose: do not call "
            "restore(), or resume=False in the Lightning/transformers integrations)"
        )
    if version is not None and not sources:
        assert tiers.primary is not None
        where = f"{tiers.primary.root} or any tier" if tiers.replicated else tiers.primary.root
        listing = tiers.committed() if tiers.replicated else tiers.primary.committed_versions()
        raise CheckpointError(
            f"version {version} is not committed in {where}; committed: {listing}"
        )
    return sources


def load_first_valid(
    sources: list[Source],
    threads: int,
    report: RestoreReport,
    backoff: float = BACKOFF,
    targets: Mapping[str, torch.Tensor] | None = None,
    spare: Spare | None = None,
) -> LoadedVersion | None:
    """Load the newest source that verifies; quarantine each one that is corrupt.

    Skipped versions are logged and recorded in ``report.skipped``; ``report.tier`` names
    the tier the loaded version came from (``None`` without tiers). ``targets``: live
    tensors to read into after verification, ``spare``: host memory to keep their old
    bytes in while reading straight into them (:func:`~pcframe.restore.reader.load_version`).

    Raises:
        RestoreIOError: a version could not be read from any tier holding it (I/O errors
            after retries); nothing was renamed.
        UnsupportedCheckpoint: the newest version is of a newer format or codec; nothing
            was renamed.
    """
    io_failed: dict[int, list[str]] = {}  # version -> I/O failures, one per source
    for source in sources:  # newest version first; a version's tiers are contiguous
        if io_failed and source.version < max(io_failed):
            break  # a newer version failed only with I/O errors: never go back silently
        if io_failed or report.skipped:
            # A failed attempt's tensors are held in a cycle by its exception's traceback:
            # freed before this one reads another copy of the state.
            collect_if_paused()
        try:
            loaded = _load_with_retries(source, threads, backoff, targets, spare)
        except UnsupportedCheckpoint as exc:
            what = f"checkpoint version {source.version}"
            what += f" in tier {source.tier}" if source.tier else ""
            raise UnsupportedCheckpoint(stop_at_unsupported(what, exc)) from None
        except ManifestError as exc:
            reason = f"in tier {source.tier}: {exc}" if source.tier else str(exc)
            report.skipped.append((source.version, reason))
            log.warning("skipping checkpoint version %d: %s", source.version, reason)
            source.quarantine(str(exc))
            continue
        except (OSError, TierError) as exc:
            where = f"tier {source.tier}: " if source.tier else ""
            io_failed.setdefault(source.version, []).append(where + describe_io(exc))
            log.warning(
                "cannot read checkpoint version %d %s(%s); not quarantined",
                source.version,
                f"from tier {source.tier} " if source.tier else "",
                describe_io(exc),
            )
            continue
        report.tier = source.tier or None
        return loaded
    if io_failed:
        version = max(io_failed)
        raise RestoreIOError(
            f"cannot read checkpoint version {version}: {'; '.join(io_failed[version])} "
            f"(after {READ_ATTEMPTS} attempts per source); nothing was renamed or deleted: "
            "fix the storage (or free file descriptors / memory) and restore again"
        )
    return None


def stop_at_unsupported(
    what: str, exc: UnsupportedCheckpoint | str, back: str = "restore(version=...) an older one"
) -> str:
    """The message of a restore that stops at ``what`` (e.g. "checkpoint version 7"), which
    this pcframe cannot read; ``back``: how to resume from an older version on purpose.
    ``exc`` already says how to read it (upgrade pcframe, import the codec's plugin)."""
    return (
        f"{what} cannot be read by this pcframe: {exc}; nothing was renamed or deleted "
        f"(falling back would drop its work); to go back on purpose: {back}"
    )


def read_with_retries(
    read: Callable[[], T], backoff: float = BACKOFF, transient: tuple[type, ...] = (OSError,)
) -> T:
    """``read()``, retried with doubling backoff on a ``transient`` error (not corruption).

    Used by both restores (single- and multi-rank): the last attempt's error propagates.
    """
    delay = backoff
    for attempt in range(READ_ATTEMPTS):
        try:
            return read()
        except ManifestError:
            raise
        except transient:
            if attempt == READ_ATTEMPTS - 1:
                raise
        # Out of the except block, where its exception is let go: the failed attempt's
        # tensors, held in a cycle by its traceback, are freed before the next one reads.
        collect_if_paused()
        time.sleep(delay)
        delay *= 2
    raise AssertionError("unreachable")


def _load_with_retries(
    source: Source,
    threads: int,
    backoff: float,
    targets: Mapping[str, torch.Tensor] | None,
    spare: Spare | None,
) -> LoadedVersion:
    def read() -> LoadedVersion:
        files = contextlib.ExitStack()
        path = None
        try:
            path = files.enter_context(source.fetch())
            loaded = load_version(
                path, threads, targets=targets, version=source.version, spare=spare
            )
            files.callback(loaded.release)  # the descriptor kept for the fill, old bytes
        except ManifestError as exc:
            files.close()
            if source.where and path is not None and str(path) in str(exc):
                # A fetched copy: name the tier's object, not the scratch folder (deleted).
                raise type(exc)(str(exc).replace(str(path), source.where)) from None
            raise
        except MemoryError:  # anywhere on the way: the machine, not the checkpoint
            files.close()
            where = path if path is not None else f"version {source.version}"
            raise out_of_memory("reading the version", None, where) from None
        except BaseException:
            files.close()
            raise
        if not loaded.in_place_bytes:
            files.close()
            return loaded
        # The verified files stay (a remote tier's download is not removed) until the
        # targets are filled from them or the caller lets the version go.
        fill = loaded.fill

        def fill_then_release(sections: Collection[str]) -> int:
            try:
                return read_with_retries(lambda: fill(sections), backoff)
            finally:
                files.close()

        loaded.fill, loaded.release = fill_then_release, files.close
        return loaded

    return read_with_retries(read, backoff, (OSError, TierError))


def describe_io(exc: BaseException) -> str:
    """An I/O error in one line: the file, the error and its errno name (``EIO``)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror} ({name})"
    return f"{type(exc).__name__}: {exc}"
