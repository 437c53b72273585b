"""The states a save goes through and the stages it can fail in.

Both are ``StrEnum``: they compare equal to their values (``SaveStatus.COMMITTED ==
"committed"``), so records written as JSON and code that reads them as text keep working.
"""

from __future__ import annotations

from enum import StrEnum


class SaveStatus(StrEnum):
    """Where one version (or one global multi-rank version) stands."""

    IN_FLIGHT = "in_flight"
    COMMITTED = "committed"
    DISCARDED = "discarded"  # finished after a newer version committed: never published
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self is not SaveStatus.IN_FLIGHT


class Stage(StrEnum):
    """The pipeline stage a failure happened in (named in ``SaveError``)."""

    SNAPSHOT = "snapshot"  # copy into staging
    ENCODE = "encode"  # codec stage
    PERSIST = "persist"  # writes into data.bin / codec.bin
    COMMIT = "commit"  # sync, manifest, publish
    ROUND = "round"  # the multi-rank agreement on a global version
