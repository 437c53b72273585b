"""Delta versions: which committed version a new one is XORed against, and what must be kept.

The chain rule:

* A version whose layout has ``xor_delta_zstd`` tensors is either **full** (those tensors
  stored with ``zstd``, depth 0) or a **delta** of exactly one *base*: the newest version
  this engine committed, if its delta tensors have the same names, dtypes and shapes, its
  directory is still committed, and ``base.depth + 1 < full_every``. Its depth is then
  ``base.depth + 1``, so restoring any version reads at most ``full_every`` versions.
* The base must already be **committed when the opener starts the delta** (not merely
  in flight), so a base can never fail or be discarded after a delta was built on it.
  After a restart there is no in-memory reference: the first version is full.
* The engine keeps, in host memory, a copy of the delta tensors' values of the newest
  committed version (the next delta's reference): extra memory of the size of those
  tensors, plus one more copy per version in flight.
* **Retention** never deletes a version that a kept version or a version in flight needs:
  the chain of each is followed base by base (read from the manifests on disk for versions
  of earlier runs) and all of it is protected.
* Restore (:mod:`pcframe.restore.reader`) reads the chain from the full version up, verifying every
  manifest and checksum on the way, and checks each link's version and depth.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from pcframe.errors import CheckpointError, UnsupportedCheckpoint
from pcframe.format.manifest import MANIFEST_NAME, DeltaLink, read_manifest
from pcframe.format.tree import DTYPES
from pcframe.save.codec import CodecPlan
from pcframe.store.directory import CheckpointDir

log = logging.getLogger("pcframe")


@dataclass
class Reference:
    """The delta tensors' values of a committed version (flat host tensors by entry index)."""

    version: int
    depth: int
    key: tuple
    values: dict[int, torch.Tensor]


@dataclass
class DeltaChoice:
    """How one version with delta tensors is stored, as chosen by :meth:`DeltaTracker.begin`.

    ``link`` is ``None`` for a full version. ``new_values`` receives this version's values
    of the delta tensors as they are staged: the reference of the next delta if it commits.
    """

    link: DeltaLink | None
    key: tuple
    base_values: dict[int, torch.Tensor] | None
    new_values: dict[int, torch.Tensor]

    def release(self) -> None:
        """Drop the value copies (the version finished; the tracker keeps what it needs)."""
        self.base_values = None
        self.new_values = {}


class DeltaTracker:
    def __init__(self, full_every: int, storage: CheckpointDir) -> None:
        self.full_every = full_every
        self.storage = storage
        self._lock = threading.Lock()
        self._reference: Reference | None = None
        self._in_flight: dict[int, int] = {}  # version in flight -> its base
        self._bases: dict[int, int | None] = {}  # committed version -> base (None: full)
        self._warned = False

    def begin(self, version: int, plan: CodecPlan, blockers: list[str]) -> DeltaChoice | None:
        """Opener thread, before any segment is encoded: make ``version`` a delta or a full one.

        Returns ``None`` when the plan has no delta tensors, or when ``blockers`` (who needs
        full versions, e.g. replica storage tiers, whose copies do not follow delta chains)
        is non-empty: the version is then stored as an ordinary coded one.
        """
        entries = plan.delta_entries
        if not entries:
            return None
        if blockers:
            if not self._warned:
                self._warned = True
                log.warning(
                    "xor_delta_zstd tensors are stored as full (zstd) versions: "
                    "%s copy single versions, not delta chains",
                    ", ".join(blockers),
                )
            return None
        key = plan.delta_key()
        link, base_values = None, None
        with self._lock:
            ref = self._reference
            usable = (
                ref is not None
                and ref.key == key
                and ref.depth + 1 < self.full_every
                and self.storage.path(ref.version).is_dir()
            )
            if usable:
                assert ref is not None
                link, base_values = DeltaLink(ref.version, ref.depth + 1), ref.values
                self._in_flight[version] = ref.version
        new_values = {
            i: torch.empty(
                plan.layout.entries[i].nbytes // DTYPES[plan.layout.entries[i].dtype].itemsize,
                dtype=DTYPES[plan.layout.entries[i].dtype],
            )
            for i in sorted(entries)
        }
        return DeltaChoice(link, key, base_values, new_values)

    def published(self, version: int, choice: DeltaChoice | None) -> None:
        """Commit thread, right after ``version`` was published and before retention runs.

        The reference moves to the newest committed version here, under the same lock as
        :meth:`begin`'s choice, so a delta that starts from now on uses this version, and
        one that chose the previous reference is already registered in flight when
        retention computes what it must keep.
        """
        with self._lock:
            link = choice.link if choice is not None else None
            self._bases[version] = link.base if link is not None else None
            if choice is not None:
                depth = link.depth if link is not None else 0
                self._reference = Reference(version, depth, choice.key, choice.new_values)
            else:
                # A newer version without delta tensors: the old reference is no longer the
                # newest committed version, so retention may delete it. Start over with a full.
                self._reference = None

    def finished(self, version: int, choice: DeltaChoice | None) -> None:
        """Commit thread, once ``version`` is committed, discarded or failed."""
        with self._lock:
            self._in_flight.pop(version, None)
        if choice is not None:
            choice.release()

    def needed_by(self, kept: set[int]) -> set[int]:
        """Every base that a kept version or a version in flight needs, transitively."""
        with self._lock:
            todo = list(kept) + list(self._in_flight.values())
            needed = set(self._in_flight.values())
        seen: set[int] = set()
        while todo:
            version = todo.pop()
            if version in seen:
                continue
            seen.add(version)
            try:
                base = self.base_of(version)
            except _BaseUnknown:
                # It may be a delta of any older version: keep them all this time.
                older = [v for v in self.storage.committed_versions() if v < version]
                needed.update(older)
                continue
            if base is not None:
                needed.add(base)
                todo.append(base)
        return needed

    def base_of(self, version: int) -> int | None:
        """The base of a committed version (``None`` for a full or corrupt one).

        Raises:
            _BaseUnknown: its manifest cannot be read now (an I/O error) or not by this
                process (a newer format, a codec whose plugin is not imported): another
                reader may need its bases, so they must not be deleted.
        """
        with self._lock:
            if version in self._bases:
                return self._bases[version]
        try:
            manifest = read_manifest(str(self.storage.path(version) / MANIFEST_NAME))
            base = manifest.delta.base if manifest.delta is not None else None
        except (OSError, UnsupportedCheckpoint) as exc:
            raise _BaseUnknown(version) from exc
        except CheckpointError:
            return None  # corrupt: restore skips it anyway, it needs nothing kept
        with self._lock:
            self._bases[version] = base
        return base


class _BaseUnknown(Exception):
    """Which version a committed version is a delta of cannot be told right now."""
