"""Where a restore can read each version: the primary directory, then every replica tier.

:func:`tier_sources` lists them newest version first and, within a version, primary
before local replicas before remote ones (the order of the tiers given), so the restore
falls back tier by tier and then version by version. A replica's copy is fetched into a
scratch directory beside the primary (``.fetch-vN-<tier>.tmp``) and verified like the
primary's; a corrupt copy is quarantined in its own tier only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from pcframe.errors import TierError
from pcframe.format.names import version_name
from pcframe.store.directory import WritableCheckpointDir
from pcframe.store.tiers.base import Tier


@dataclass(frozen=True)
class Source:
    """One place a restore can read ``version`` from."""

    version: int
    tier: str
    fetch: Callable[[], AbstractContextManager[Path]]
    quarantine: Callable[[str], None]  # set the version aside, recording why
    where: str = ""  # the version's place in a replica tier (its URL), for messages


def tier_sources(
    primary: WritableCheckpointDir,
    primary_name: str,
    replicas: Sequence[tuple[str, Tier]],
    version: int | None = None,
) -> tuple[list[Source], list[str]]:
    """Every place ``version`` (or any version) can be read from, newest first; plus the
    replica tiers that could not be listed, each as ``'name: reason'``."""
    by_version: dict[int, list[Source]] = {}

    def add(v: int, source: Source) -> None:
        by_version.setdefault(v, []).append(source)

    for v in primary.committed_versions():
        add(
            v,
            Source(
                v,
                primary_name,
                lambda v=v: contextlib.nullcontext(primary.path(v)),
                lambda why, v=v: primary.quarantine(v, why),
            ),
        )
    unavailable = []
    for name, tier in replicas:
        try:
            listed = tier.committed_versions()
        except TierError as exc:
            unavailable.append(f"{name}: {exc}")
            continue
        for v in listed:
            scratch = primary.root / f".fetch-{version_name(v)}-{name}.tmp"
            add(
                v,
                Source(
                    v,
                    name,
                    lambda t=tier, v=v, s=scratch: t.fetch(v, s),
                    lambda why, t=tier, v=v: t.quarantine(v, why),
                    f"{tier.location.rstrip('/')}/{version_name(v)}",
                ),
            )
    chosen = sorted(by_version, reverse=True)
    if version is not None:
        chosen = [v for v in chosen if v == version]
    return [s for v in chosen for s in by_version[v]], unavailable
