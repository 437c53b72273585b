"""Where a restore reads from, and the newest-first walk that falls back on failure."""

from __future__ import annotations

import logging

from pcframe.errors import CheckpointError, ManifestError
from pcframe.restore.reader import LoadedVersion, load_version
from pcframe.restore.report import RestoreReport
from pcframe.store.tiers import Source, Tiers

log = logging.getLogger("pcframe")


def restore_sources(tiers: Tiers, version: int | None, report: RestoreReport) -> list[Source]:
    """Every place holding a committed version, newest first (only ``version`` if given).

    With replica tiers each version is offered tier by tier (primary, local, remote); tiers
    that cannot be listed are recorded in ``report.unavailable``.

    Raises:
        CheckpointError: ``version`` was asked for and is committed nowhere.
    """
    sources, report.unavailable = tiers.sources(version)
    for reason in report.unavailable:
        log.warning("pcframe: restore cannot see tier %s", reason)
    if version is not None and not sources:
        assert tiers.primary is not None
        where = f"{tiers.primary.root} or any tier" if tiers.replicated else tiers.primary.root
        listing = tiers.committed() if tiers.replicated else tiers.primary.committed_versions()
        raise CheckpointError(
            f"version {version} is not committed in {where}; committed: {listing}"
        )
    return sources


def load_first_valid(
    sources: list[Source], threads: int, report: RestoreReport
) -> LoadedVersion | None:
    """Load the first source that verifies; quarantine each one that does not.

    Skipped versions are logged and recorded in ``report.skipped``; ``report.tier`` names
    the tier the loaded version came from (``None`` without tiers).
    """
    for source in sources:
        try:
            with source.fetch() as path:
                loaded = load_version(path, threads)
        except (ManifestError, OSError) as exc:
            reason = f"in tier {source.tier}: {exc}" if source.tier else str(exc)
            report.skipped.append((source.version, reason))
            log.warning("pcframe: skipping checkpoint version %d: %s", source.version, reason)
            source.quarantine()
            continue
        report.tier = source.tier or None
        return loaded
    return None
