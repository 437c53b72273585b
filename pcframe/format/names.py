"""Names on disk: what a version's directory is called and which file names may appear.

A committed version lives in ``vNNNNNNNN`` (at least eight digits, zero-padded), in a local
checkpoint directory as under a remote tier's prefix. The files of a version (named by its
manifest, listed by a tier, recorded in a commit marker) must match :data:`SAFE_FILE`, so a
hostile manifest or listing can never name a path outside the version.
"""

from __future__ import annotations

import re

# The digits of a version in its name; the one spelling every name pattern is built from.
VERSION_DIGITS = r"v(\d{8,})"
# A committed version's directory (``v00000012``); ``vNNNNNNNN.tmp`` and others do not match.
VERSION_DIR = re.compile(rf"^{VERSION_DIGITS}$")
# A file name a version may hold: no path separators, no leading dot, at most 128 characters.
SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def version_name(version: int) -> str:
    """The directory name of ``version`` (12 -> ``v00000012``)."""
    return f"v{version:08d}"


def version_number(name: str) -> int | None:
    """The version a committed directory's name stands for (``v00000012`` -> 12), else None."""
    match = VERSION_DIR.match(name)
    return int(match.group(1)) if match else None
