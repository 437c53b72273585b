"""What a storage tier must offer the replicator and the restore path.

A *tier* is one place a committed checkpoint version can live: the engine's own directory
(the primary tier, written by the save pipeline), a second local directory, or an object
store. Replica tiers are filled from versions already committed in the primary tier, so a
tier only needs to copy a finished version directory in its own crash-safe way: after a crash
at any moment a version is either fully listed or not listed at all.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

from pcframe.errors import TierError
from pcframe.format.manifest import MANIFEST_NAME
from pcframe.format.names import SAFE_FILE
from pcframe.runtime.checks import finite_number

# A tier's name is a config key and part of a restore's scratch folder name
# (``.fetch-vN-<name>.tmp``): no path separators, no leading dot.
TIER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")


def check_tier_name(name: object) -> str:
    if not isinstance(name, str) or not TIER_NAME.match(name):
        raise TierError(
            f"tiers: {name!r} is not a tier name; use letters, digits, '_', '-' and '.' (at "
            "most 64, not starting with '.' or '-'), e.g. 'remote' or 'nvme.1'"
        )
    return name


def number_option(value: object, key: str, *, low: float, low_ok: bool) -> float:
    """``value`` as a float if it is a finite number above ``low`` (or at it, ``low_ok``);
    else a :class:`TierError` naming ``key`` (NaN passed every comparison before)."""
    fits = finite_number(value) and (value >= low if low_ok else value > low)
    if not fits:
        bound = f">= {low:g}" if low_ok else f"> {low:g}"
        raise TierError(f"{key}={value!r}: give a finite number {bound}")
    return float(value)


class Tier(ABC):
    """One storage location of committed versions.

    Implementations must make :meth:`write` atomic as seen by :meth:`committed_versions`
    (a crash leaves a complete version or nothing listed) and :meth:`delete` such that a crash
    never leaves a listed but partial version. ``name`` is set by
    :class:`~pcframe.store.tiers.Tiers` to the key the tier was configured under.
    """

    name: str = ""
    #: Whether this tier lives in the local machine's file system (restores need no download).
    local: bool = True

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the tier is (a path or URL), for messages."""

    @abstractmethod
    def committed_versions(self) -> list[int]:
        """Complete versions in this tier, oldest first.

        Raises:
            TierError: the tier cannot be listed (unreachable, missing bucket, ...).
        """

    @abstractmethod
    def write(self, version: int, source: Path, step: int | None = None) -> int:
        """Copy the committed version directory ``source`` into this tier; return bytes written.

        ``step`` is the training step the version holds (informative, for listings).

        Must either commit the version completely or leave it unlisted (and raise).
        """

    @abstractmethod
    def delete(self, version: int) -> None:
        """Remove a version so that no crash leaves it listed but incomplete."""

    @abstractmethod
    def fetch(self, version: int, scratch: Path) -> AbstractContextManager[Path]:
        """A context manager yielding a local directory holding ``version``'s files.

        Remote tiers download into ``scratch`` (a fresh directory they may create and must
        remove on exit); local tiers yield their own directory.
        """

    def manifest_crc(self, version: int) -> str | None:
        """The body checksum in the header of ``version``'s manifest here (what tells this
        tier's copy of a version from another run's version of the same number), or ``None``
        where the tier cannot tell (its copy is then taken for another run's).

        Raises:
            TierError / CorruptCheckpoint / OSError: the manifest is missing or unreadable.
        """
        del version
        return None

    def quarantine(self, version: int, reason: str = "") -> None:  # noqa: B027 - optional hook
        """Move a version that failed verification (``reason``) out of the listing (local
        tiers only)."""

    def sweep(self) -> list[str]:
        """Delete leftovers of interrupted writes or deletes; return what was removed."""
        return []

    def cancel(self) -> None:  # noqa: B027 - optional hook
        """Abort a :meth:`write` running on another thread (it raises :class:`TierCancelled`)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release locks and connections."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name or '?'}: {self.location})"


def version_files(directory: Path) -> Iterator[Path]:
    """The regular files of a version directory, the manifest last (it is the commit record)."""
    files = sorted(p for p in directory.iterdir() if p.is_file())
    bad = [p.name for p in files if not SAFE_FILE.match(p.name)]
    if bad:
        raise TierError(f"{directory}: unexpected file names {bad} in a checkpoint version")
    yield from (p for p in files if p.name != MANIFEST_NAME)
    yield from (p for p in files if p.name == MANIFEST_NAME)
