"""``StorageReader``: ``dcp.load`` from pcframe versions, every chunk verified before any is placed.

DCP's ``Metadata`` is built from the JSON manifests (:func:`schema.build_metadata`, which
validates every field of every item and that each tensor's chunks tile it exactly); nothing
is unpickled by pcframe. Tensor chunks are read with the engine's one reader
(:func:`pcframe.restore.reader.read_entries`: parallel ``preadv``, each chunk's checksum
checked), and only once every shard this rank reads has verified are they copied into the
tensors DCP's planner resolves (any device), so a damaged shard leaves the destination as it
was. Non-tensor items stored as JSON values are handed to the planner as ``torch.save``
bytes of the decoded value, so DCP's ``torch.load`` only ever reads bytes pcframe made
itself; items that were stored pickled are refused unless ``allow_pickle=True`` (DCP's
default planner unpickles them with ``weights_only=False``).

Which version, as the engine's own restore chooses (:mod:`pcframe.restore.sources`): the
newest one whose manifests and data files are all there and valid; a damaged one is skipped
with one warning line naming the file and the field; a version of a newer format stops the
load (:class:`~pcframe.errors.UnsupportedCheckpoint`: going back past it would drop its work,
and the next saves' retention would delete it); an I/O error stops it too
(:class:`~pcframe.errors.RestoreIOError`), after retries.

Beside a live writer, whose retention deletes versions while they are read: a version that
is gone (no longer listed) was pruned, not damaged, and the root is listed again (up to
``LISTINGS`` walks, as :func:`pcframe.load` does). Once DCP has planned the load, the data
files of the shards the plan reads are held open (:meth:`StorageReader.prepare_local_plan`,
:class:`~pcframe.integrations.dcp.held.HeldVersion`), so a prune after that point cannot
touch the read; one before it makes the reader take the newest version instead, if the plan
fits it. The ranks of one load all read one version: each reports the version it holds in
its plan, and the coordinator picks the newest.

Errors in choosing the version are raised from ``set_up_storage_reader``, DCP's next call,
not from ``read_metadata``: DCP answers a failed ``read_metadata`` with its own
``AssertionError`` and a logged traceback, burying the one line that says what is wrong.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from pcframe.errors import (
    CheckpointError,
    CorruptCheckpoint,
    ManifestError,
    NoValidCheckpoint,
    RestoreIOError,
    UnsupportedCheckpoint,
)
from pcframe.format.names import check_requested_version
from pcframe.integrations.dcp import root as roots
from pcframe.integrations.dcp.held import HeldVersion, Read, damaged, data_files, placement
from pcframe.integrations.dcp.schema import ReadIndex, build_metadata
from pcframe.restore.reader import read_entries
from pcframe.restore.restorer import LISTINGS, check_read_threads
from pcframe.restore.sources import (
    READ_ATTEMPTS,
    describe_io,
    read_with_retries,
    stop_at_unsupported,
)
from pcframe.runtime.collector import collector_paused

log = logging.getLogger("pcframe")


class StorageReader(_DcpStorageReader):
    """Read a ``dcp.load`` checkpoint from a pcframe root written by :class:`StorageWriter`.

    Args:
        path: the pcframe root (``None``: the ``checkpoint_id`` of the load is the root).
        version: the version to load; by default the newest one whose manifests and data
            files verify (a damaged newer one is skipped with a warning; one of a newer
            format stops the load). A ``checkpoint_id`` that is not the root selects the
            newest version saved with that ``checkpoint_id``.
        allow_pickle: load non-tensor items that were stored as pickled bytes (values
            pcframe's JSON tree cannot hold); DCP's planner unpickles those, so only for
            checkpoints you trust.
        threads: reader threads per shard.
        process_group: the group ``dcp.load`` runs on, when not the default one: the ranks
            agree on it that every part verified before any of them places a byte.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        version: int | None = None,
        allow_pickle: bool = False,
        threads: int = 8,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        # The group dcp.load runs on, where the ranks agree that every part verified before
        # any rank places a byte (None: the default group, when the load spans all of it).
        self.process_group = process_group
        check_requested_version(version, "StorageReader(version=...)")
        if not isinstance(allow_pickle, bool):  # "no" is truthy: it would unpickle
            raise TypeError(f"StorageReader(allow_pickle={allow_pickle!r}): give True or False")
        check_read_threads("StorageReader", threads)
        self.root = Path(path) if path is not None else None
        self.version = version
        self.allow_pickle = allow_pickle
        self.threads = threads
        self.checkpoint_id: str | None = None
        self.loaded: roots.Committed | None = None  # the version this load reads
        self._chosen: HeldVersion | None = None
        self._planned: ReadIndex | None = None  # the index DCP planned the load with
        self._failed: BaseException | None = None  # why read_metadata chose no version
        # Closes the held files of a load DCP abandoned (another rank failed to plan).
        self._finalizer: weakref.finalize | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if self.root is None and checkpoint_id is not None:
            self.root = Path(checkpoint_id)
        self.checkpoint_id = None if checkpoint_id is None else str(checkpoint_id)
        self._let_go()

    def read_metadata(self, *args: Any) -> Metadata:  # no **kwargs: see the module notes
        """The chosen version's DCP ``Metadata`` (its manifests validated).

        If no version can be read, the ``Metadata`` returned holds the error: DCP's next
        call (``set_up_storage_reader``) raises it, and so does any use of its items.
        """
        self._let_go()
        try:
            self._choose_version()
        except (CheckpointError, OSError, ValueError) as exc:
            self._failed = exc
            return Metadata(state_dict_metadata=_Unreadable(exc))
        assert self._planned is not None
        return self._planned.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        del metadata, is_coordinator, args, kwargs
        self._raise_failure()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Hold open the data files of the shards this plan reads, and name the version in
        the plan (the coordinator makes every rank read one)."""
        self._raise_failure()
        opened = self._hold_for(plan)
        return dataclasses.replace(plan, storage_data=opened.committed.version)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: every rank reads the same version, the newest any rank holds (ranks
        differ only when a writer committed while they chose), and learns how many ranks
        load (they agree before placing: :meth:`read_data`)."""
        versions = {p.storage_data for p in plans if _is_version(p.storage_data)}
        if len(versions) > 1:
            log.info(
                "the ranks of this load chose versions %s of %s (a writer committed "
                "meanwhile); all read version %d",
                sorted(versions),
                self.root,
                max(versions),
            )
        newest = max(versions) if versions else None
        return [dataclasses.replace(p, storage_data=_Agreed(newest, len(plans))) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read and verify every item of this rank's plan; once every rank of the load has
        verified its part, place them (a failure anywhere: no rank places a byte)."""
        failure: BaseException | None = None
        try:
            self._raise_failure()
            opened, reads = self._agreed(plan)
            self._refuse_pickles(opened, reads)
            # As in pcframe's own restores (pcframe.runtime.collector): no full collections
            # of the whole process set off among the read's short-lived objects; a failed
            # read's cycle is freed when the pause ends.
            with collector_paused():
                stored = self._read_all(opened, reads)  # every shard verified, nothing placed
                # every destination checked too: a broadcast view on one rank fails them all
                ready = placement(reads, stored, planner, opened.committed)
        except Exception as exc:  # told to the other ranks first: none of them places
            failure = exc
        try:
            elsewhere = self._failed_elsewhere(plan, failure)
            if failure is not None:
                raise failure
            if elsewhere:
                raise CorruptCheckpoint(
                    f"{self.root}: version {opened.committed.version} was not loaded: "
                    f"{elsewhere}; nothing was placed on this rank either"
                )
            with collector_paused():
                ready.place()
        finally:
            self._let_go()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _failed_elsewhere(self, plan: LoadPlan, failure: BaseException | None) -> str:
        """What failed on the other ranks of this load ("" if nothing): one all-gather on
        the load's group, so a rank places only once every rank verified its part. Skipped
        for a load of one rank, and when the group is unknown (``dcp.load`` on a subgroup
        without ``process_group=`` given here: each rank then places what it verified)."""
        note = plan.storage_data
        ranks = note.ranks if isinstance(note, _Agreed) else 1
        if ranks <= 1 or not dist.is_available() or not dist.is_initialized():
            return ""
        group = self.process_group
        if group is None:
            if dist.get_world_size() != ranks:
                return ""  # not the default group: which one is DCP's own business
            group = dist.group.WORLD
        mine = "" if failure is None else f"{type(failure).__name__}: {failure}"
        outcomes: list[Any] = [None] * ranks
        dist.all_gather_object(outcomes, (dist.get_rank(), mine), group=group)
        return "; ".join(f"rank {r} failed ({why})" for r, why in outcomes if why and why != mine)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a pcframe root holding a committed version."""
        try:
            return bool(roots.candidates(Path(checkpoint_id)))
        except (OSError, TypeError, CheckpointError):
            return False

    # --- choosing the version ---------------------------------------------------------------

    def _choose_version(self) -> None:
        if self.root is None:
            raise ValueError(
                "pcframe StorageReader has no directory: give StorageReader(path) or "
                "dcp.load(..., checkpoint_id=path)"
            )
        label = self.checkpoint_id
        if label is not None and Path(label) == self.root:
            label = None
        opened = self._exactly(self.version) if self.version is not None else self._newest(label)
        self._hold(opened)
        self._planned = opened.index

    def _newest(self, label: str | None = None) -> HeldVersion:
        """The newest version that opens (saved as ``label``, if given): a damaged one is
        skipped, one pruned while it was opened sends the walk back to a new listing."""
        root = self.root
        assert root is not None
        skipped: list[str] = []
        labels: list[str] = []
        tried: set[int] = set()
        pruned = 0
        for _ in range(LISTINGS):
            relist = False
            for number in roots.candidates(root):
                if number in tried:
                    continue
                tried.add(number)
                try:
                    opened = self._open(number)
                except UnsupportedCheckpoint as exc:
                    older = [v for v in roots.candidates(root) if v < number]
                    back = f"StorageReader(root, version={older[0] if older else 'N'})"
                    raise UnsupportedCheckpoint(
                        stop_at_unsupported(
                            f"checkpoint version {number} of {root}",
                            exc,
                            f"load an older version with {back}",
                        )
                    ) from None
                except ManifestError as exc:
                    if self._gone(number):
                        log.info(
                            "checkpoint version %d of %s is gone (deleted by a live writer's "
                            "retention while it was opened); listing again",
                            number,
                            root,
                        )
                        pruned += 1
                        relist = True
                        break
                    log.warning("skipping checkpoint version %d in %s: %s", number, root, exc)
                    skipped.append(f"v{number}: {exc}")
                    continue
                if label is None or opened.index.checkpoint_id == label:
                    return opened
                labels.append(f"v{number}: {opened.index.checkpoint_id!r}")
            if not relist:
                break
        if label is not None:
            raise NoValidCheckpoint(
                f"{root}: no committed version was saved with checkpoint_id {label!r} (have "
                f"{', '.join(labels) or 'none'}); pass StorageReader(root) for the newest"
            )
        if skipped:
            raise NoValidCheckpoint(
                f"{root}: no committed version verifies ({'; '.join(skipped)}); `pcframe "
                f"verify {root}` names the damage"
            )
        if pruned:
            raise NoValidCheckpoint(
                f"{root}: each version listed was deleted by a live writer's retention while "
                f"it was opened ({LISTINGS} listings); load again, or keep more versions "
                "(StorageWriter(keep_last=...))"
            )
        raise NoValidCheckpoint(
            f"{root}: no committed pcframe version to load; check the path (`pcframe list {root}`)"
        )

    def _exactly(self, number: int) -> HeldVersion:
        """Version ``number``, or an error: never another version."""
        root = self.root
        assert root is not None
        if number not in roots.candidates(root):
            raise CheckpointError(
                f"{root}: version {number} is not committed; committed: "
                f"{sorted(roots.candidates(root))}"
            )
        try:
            return self._open(number)
        except UnsupportedCheckpoint as exc:
            raise UnsupportedCheckpoint(
                f"checkpoint version {number} of {root} cannot be read by this pcframe: {exc}"
            ) from None
        except ManifestError:
            if self._gone(number):
                raise CheckpointError(
                    f"{root}: version {number} was deleted by a live writer's retention while "
                    f"it was opened; committed now: {sorted(roots.candidates(root))}"
                ) from None
            raise

    def _open(self, number: int) -> HeldVersion:
        """Version ``number`` with its manifests validated and every data file checked to be
        there at its size (a missing shard is found before DCP plans, when going back to an
        older version is still possible). Transient I/O errors are retried.

        Raises:
            UnsupportedCheckpoint, ManifestError: naming the file (and the field).
            RestoreIOError: the files cannot be read (I/O errors after retries).
        """
        root = self.root
        assert root is not None

        def read() -> HeldVersion:
            committed = roots.open_version(root, number)
            paths = {r: committed.manifest_path(r) for r in committed.directories}
            world = committed.world_size
            record = str(committed.record) if committed.record is not None else None
            index = build_metadata(committed.manifests, paths, world, record)
            for rank, directory in committed.directories.items():
                data_files(directory, committed.manifests[rank])  # sizes checked, closed
            return HeldVersion(committed, index)

        try:
            return read_with_retries(read)
        except OSError as exc:
            raise RestoreIOError(
                f"cannot read checkpoint version {number} of {root}: {describe_io(exc)} (after "
                f"{READ_ATTEMPTS} attempts); nothing was placed: fix the storage and load again"
            ) from None

    def _gone(self, number: int) -> bool:
        """Whether ``number`` is no longer listed: a live writer's retention deleted it (a
        version that is still listed and fails is damaged)."""
        try:
            return number not in roots.candidates(self.root) if self.root else False
        except (OSError, CheckpointError):
            return False

    # --- holding the files -------------------------------------------------------------------

    def _hold(self, opened: HeldVersion) -> None:
        self._let_go()
        self._chosen, self.loaded = opened, opened.committed
        self._finalizer = weakref.finalize(self, opened.let_go)

    def _let_go(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # closes the held files, once
        self._chosen, self._failed, self._finalizer = None, None, None

    def _hold_for(self, plan: LoadPlan) -> HeldVersion:
        """The chosen version with the data files this plan reads held open; if a live
        writer pruned it after it was chosen, the newest version instead, if the plan fits
        it (only when no particular version was asked for)."""
        opened = self._chosen
        assert opened is not None and self._planned is not None
        for _ in range(LISTINGS):
            reads = opened.locate(plan, self._planned)
            try:
                opened.hold(reads)
                return opened
            except ManifestError as exc:
                number = opened.committed.version
                if not self._gone(number):
                    raise damaged(exc, opened) from None
                if self.version is not None or self._label() is not None:
                    raise CheckpointError(
                        f"{self.root}: version {number} was deleted by a live writer's "
                        "retention while this load was planned; load again"
                    ) from None
                log.info(
                    "checkpoint version %d of %s is gone (deleted by a live writer's retention "
                    "after this load chose it); listing again",
                    number,
                    self.root,
                )
                opened = self._newest()
                self._hold(opened)
        raise NoValidCheckpoint(
            f"{self.root}: each version chosen was deleted by a live writer's retention before "
            f"its files were opened ({LISTINGS} times); load again, or keep more versions"
        )

    def _agreed(self, plan: LoadPlan) -> tuple[HeldVersion, list[Read]]:
        """The version the coordinator chose for every rank, the files of the shards this
        plan reads held open, and the stored item of each read."""
        opened = self._chosen
        if opened is None:
            raise CheckpointError("StorageReader.read_data before read_metadata")
        note = plan.storage_data
        agreed = note.version if isinstance(note, _Agreed) else note
        if _is_version(agreed) and agreed != opened.committed.version:
            # Another rank holds a newer version: read that one too, so no rank mixes two.
            # No listing again from here: the ranks could not agree on its outcome.
            try:
                opened = self._open(agreed)
            except ManifestError as exc:
                gone = "was deleted meanwhile" if self._gone(agreed) else f"fails: {exc}"
                raise CheckpointError(
                    f"{self.root}: the ranks of this load chose different versions (a writer "
                    f"committed while they chose) and version {agreed}, the newest, {gone}; "
                    "load again"
                ) from None
            self._hold(opened)
        reads = opened.locate(plan, self._planned)
        try:
            opened.hold(reads)
        except ManifestError as exc:
            if not self._gone(opened.committed.version):
                raise damaged(exc, opened) from None
            raise CheckpointError(
                f"{self.root}: version {opened.committed.version} was deleted by a live "
                "writer's retention while this load was planned; load again"
            ) from None
        return opened, reads

    def _label(self) -> str | None:
        label = self.checkpoint_id
        return None if label is None or Path(label) == self.root else label

    def _raise_failure(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._chosen is None:
            raise CheckpointError("pcframe StorageReader: read_metadata was not called first")

    # --- reading ----------------------------------------------------------------------------

    def _refuse_pickles(self, opened: HeldVersion, reads: list[Read]) -> None:
        if self.allow_pickle:
            return
        for read in reads:
            if read.item.kind == "pickled":
                raise CheckpointError(
                    f"{opened.committed.directories[read.rank]}: '{read.item.fqn}' was stored "
                    "as pickled bytes (not a JSON-able value when saved) and DCP's planner "
                    "would unpickle it with torch.load(weights_only=False); pass "
                    "StorageReader(..., allow_pickle=True) if you trust this checkpoint, or "
                    "save that value as tensors / JSON-able data"
                )

    def _read_all(
        self, opened: HeldVersion, reads: list[Read]
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Every stored tensor the reads need, by (rank, entry), each chunk verified.

        All shards are read before any byte is placed, so a damaged one (another rank's,
        say) leaves the destination untouched. The bytes are still read once, into fresh
        tensors, and copied once into the destination; what it costs is memory: this
        rank's whole part of the version is held until it is placed.
        """
        wanted: dict[int, set[int]] = defaultdict(set)
        for read in reads:
            if read.item.entry is not None:
                wanted[read.rank].add(read.item.entry)
        committed = opened.committed
        stored: dict[tuple[int, int], torch.Tensor] = {}
        for rank in sorted(wanted):
            directory, manifest = committed.directories[rank], committed.manifests[rank]

            def read(rank: int = rank, directory: Path = directory, manifest: Any = manifest):
                files = opened.files[rank]
                return read_entries(directory, manifest, wanted[rank], self.threads, files=files)

            try:
                tensors = read_with_retries(read)
            except ManifestError as exc:
                raise damaged(exc, opened) from None
            except OSError as exc:
                raise RestoreIOError(
                    f"cannot read checkpoint version {committed.version} of {self.root}: "
                    f"{describe_io(exc)} (after {READ_ATTEMPTS} attempts); nothing was placed: "
                    "fix the storage and load again"
                ) from None
            stored.update({(rank, entry): t for entry, t in tensors.items()})
        return stored


@dataclasses.dataclass(frozen=True)
class _Agreed:
    """The coordinator's word to every rank of a load: the version all read (``None``: each
    its own, a one-rank root) and how many ranks load."""

    version: int | None
    ranks: int


def _is_version(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Unreadable(dict):  # type: ignore[type-arg]
    """The items of the ``Metadata`` returned when no version could be chosen: empty, and
    any use of them raises why (DCP's own load stops earlier, at set_up_storage_reader)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def _raise(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error

    __getitem__ = __iter__ = __len__ = __contains__ = _raise
    keys = values = items = get = _raise
