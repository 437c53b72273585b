"""Names on disk: what a version's directory is called and which file names may appear.

A committed version lives in ``vNNNNNNNN`` (at least eight digits, zero-padded), in a local
checkpoint directory as under a remote tier's prefix. The files of a version (named by its
manifest, listed by a tier, recorded in a commit marker) must match :data:`SAFE_FILE`, so a
hostile manifest or listing can never name a path outside the version.

Version numbers are at most :data:`MAX_VERSION`. A name with a larger number (a stray
``v`` + 20 digits directory, a LATEST or remote key saying so) is ignored with a warning:
it must never become the number new versions are counted from, or every later version
would be one no reader accepts.
"""

from __future__ import annotations

import logging
import numbers
import re
from typing import Any

from pcframe.errors import CheckpointError

# The files of one version's folder.
MANIFEST_NAME = "manifest.json"
DATA_NAME = "data.bin"  # raw tensors, in chunks (or striped: pcframe.format.stripes)
CODEC_NAME = "codec.bin"  # coded tensors' segments (format version 2)

log = logging.getLogger("pcframe")

# The largest version number pcframe writes or reads: a trillion versions (one per second
# for 31,000 years), far below where any integer arithmetic on it could overflow.
MAX_VERSION = 10**12
# The digits of a version in its name; the one spelling every name pattern is built from.
VERSION_DIGITS = r"v(\d{8,})"
# A committed version's directory (``v00000012``); ``vNNNNNNNN.tmp`` and others do not match.
VERSION_DIR = re.compile(rf"^{VERSION_DIGITS}$")
# A rank's folder in a multi-rank root, peer store or fetched folder (``rank-3``).
RANK_DIR = re.compile(r"^rank-(\d{1,7})$")
# A file name a version may hold: no path separators, no leading dot, at most 128 characters.
SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_warned: set[str] = set()


def check_requested_version(version: Any, what: str = "restore(version=...)") -> None:
    """Refuse a version asked for by a caller that no folder can be named by: not an int
    (``'2'``, ``2.0``, ``True``: a bool is an int to Python, and ``True`` would quietly read
    version 1), or below 1. ``None`` (the newest) passes.

    Raises:
        TypeError: not an integer, naming the value and the fix.
        CheckpointError: an integer outside 1..MAX_VERSION.
    """
    if version is None:
        return
    if isinstance(version, bool) or not isinstance(version, numbers.Integral):
        raise TypeError(
            f"{what} takes a version number (an int such as 12) or None for the newest valid "
            f"one; got {version!r} ({type(version).__name__})"
        )
    if not 1 <= version <= MAX_VERSION:
        raise CheckpointError(
            f"{what}: version {version} cannot exist (versions are numbered from 1 to "
            f"{MAX_VERSION}); list the committed ones with pcframe list DIRECTORY"
        )


def check_new_version(forced: int | None, next_version: int) -> None:
    """Refuse a new version number: a ``forced`` one (coordinated multi-rank saves) at or
    below the last, or one above :data:`MAX_VERSION`.

    Raises:
        CheckpointError: naming the number and the fix.
    """
    if forced is not None and forced < next_version:
        raise CheckpointError(f"version {forced} is not above the last version {next_version - 1}")
    if (forced or next_version) > MAX_VERSION:
        raise CheckpointError(
            f"version {forced or next_version} would be above the limit {MAX_VERSION}: start a "
            "new checkpoint directory"
        )


def version_name(version: int) -> str:
    """The directory name of ``version`` (12 -> ``v00000012``)."""
    return f"v{version:08d}"


def version_from_digits(digits: str, where: str) -> int | None:
    """``digits`` (a regex group of :data:`VERSION_DIGITS`) as a version; None if too big or
    not spelled as pcframe spells it (zero-padded to eight digits, no further zeros).

    ``where`` names the file or key for the warning.
    """
    if digits != f"{int(digits):08d}":  # v000000012: not a name pcframe writes for 12, and
        # taking it for 12 would read, prune and delete through another name (v00000012)
        return None
    if len(digits) > len(str(MAX_VERSION)) or int(digits) > MAX_VERSION:
        if where not in _warned:  # once per name: listings run at every commit
            _warned.add(where)
            log.warning(
                "ignoring %s: version number %s is above the limit %d (not "
                "written by pcframe; remove or rename it)",
                where,
                digits[:24] + ("..." if len(digits) > 24 else ""),
                MAX_VERSION,
            )
        return None
    return int(digits)


def version_number(name: str, where: str | None = None) -> int | None:
    """The version a committed directory's name stands for (``v00000012`` -> 12), else None.

    Names whose number is above :data:`MAX_VERSION` give None (with a warning).
    """
    match = VERSION_DIR.match(name)
    if not match:
        return None
    return version_from_digits(match.group(1), where or name)
