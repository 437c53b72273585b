"""A multi-rank checkpoint in an object store: every rank's shards and the global records.

Layout under the URL a :class:`~pcframe.distributed.DistributedCheckpointer` is given as a
remote tier::

    <url>/rank-<r>/vNNNNNNNN/...     rank r's shard, uploaded by rank r's own engine (a
                                     :class:`~pcframe.store.tiers.RemoteTier`: commit marker
                                     last, so a listed version is complete)
    <url>/global/vNNNNNNNN.json      the global record, uploaded by rank 0 once published

The ranks upload apart, so rank 0 uploads a version's record only once every rank reported
its shard of it in the object store (the commit protocol's ``remote_whole``), and each rank's
tier then holds that version whatever its own retention says: the object store always has
one whole version, and its records are those of whole versions (the newest two are kept).
A restore lists it once (:meth:`RemoteShards.committed`: one recursive listing, not a call
per rank), and uses it when the nodes' own copies are not enough.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pcframe.distributed.global_versions import GlobalRecord, rank_dirname
from pcframe.errors import TierError
from pcframe.format.names import version_name
from pcframe.store.tiers.remote import RemoteTier

log = logging.getLogger("pcframe")

_RECORD = re.compile(r"^v(\d{8,})\.json$")
_COMMITTED = re.compile(r"^rank-(\d{1,7})/v(\d{8,})/COMMITTED$")  # a shard's commit marker
MAX_RECORD_BYTES = 16 * 1024 * 1024


def rank_url(url: str, rank: int) -> str:
    """Where rank ``rank`` uploads its shards under ``url``."""
    return f"{url.rstrip('/')}/{rank_dirname(rank)}"


class RemoteShards:
    """Read access to every rank's shards under ``url``, and the records (see module)."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        """``options``: the tier's own (``storage_options``, ``create``, ``timeout``, ...)."""
        self.url = url.rstrip("/")
        self.options = dict(options or {})
        self._tiers: dict[int, RemoteTier] = {}
        self._records = RemoteTier(f"{self.url}/global", **self.options)
        self._records.name = "remote/global"

    def tier(self, rank: int) -> RemoteTier:
        tier = self._tiers.get(rank)
        if tier is None:
            tier = self._tiers[rank] = RemoteTier(rank_url(self.url, rank), **self.options)
            tier.name = f"remote/{rank_dirname(rank)}"
        return tier

    def committed(self) -> dict[int, list[int]]:
        """Every rank's committed shards in the object store, ``{rank: [versions]}``, from
        one recursive listing.

        Raises:
            TierError: the listing failed or timed out, or the bucket does not exist while
                the tiers may not create it.
        """
        paths = self._records.find_under_parent()
        base = self._records.root.rsplit("/", 1)[0]
        found: dict[int, set[int]] = {}
        for path in paths:
            match = _COMMITTED.match(path[len(base) :].lstrip("/"))
            if match:
                found.setdefault(int(match.group(1)), set()).add(int(match.group(2)))
        return {rank: sorted(versions) for rank, versions in found.items()}

    def put_record(self, record: GlobalRecord, keep: int = 2) -> None:
        """Upload the record of a version now whole in the object store (rank 0), then
        delete the records older than the newest ``keep``.

        Raises:
            TierError: the upload failed or did not finish within the tier's deadline.
        """
        tier = self._records
        tier.put_small(f"{version_name(record.version)}.json", record.to_bytes())
        try:  # uploaded: older records that stay are pruned after a later upload
            versions = sorted(int(m.group(1)) for m in map(_RECORD.match, tier.names()) if m)
            for old in versions[:-keep]:
                tier.remove_small(f"{version_name(old)}.json")
        except TierError as exc:
            log.warning("global record v%d uploaded, older ones kept: %s", record.version, exc)

    def records(self) -> dict[int, bytes]:
        """The record files in the object store, by version (``{}`` if there are none; one
        larger than MAX_RECORD_BYTES is left out unread).

        Raises:
            TierError: the object store failed or did not answer within the tier's deadline
                (a restore must not take that for "no record").
        """
        tier = self._records
        found = {}
        for name in tier.names():
            match = _RECORD.match(name)
            if not match:
                continue
            raw = tier.read_small(name, MAX_RECORD_BYTES)
            if raw is not None and len(raw) <= MAX_RECORD_BYTES:
                found[int(match.group(1))] = raw
        return found

    def fetch(self, rank: int, version: int, into: Path) -> None:
        """Download rank ``rank``'s shard of ``version`` into the new folder ``into``."""
        scratch = into.with_name(into.name + ".download")
        with self.tier(rank).fetch(version, scratch) as fetched:
            os.rename(fetched, into)
