"""``StorageWriter``: torch.distributed.checkpoint saves written as pcframe versions.

What DCP hands to :meth:`StorageWriter.write_data` (the tensors and bytes of one rank's
plan) goes through the engine's own save pipeline (:class:`pcframe.save.pipeline.
SavePipeline`): staged chunk by chunk, checksummed and written by the writer threads into
``data.bin``, then committed (fdatasync, manifest, rename, LATEST) and retained (keep_last)
by the engine's committer. The DCP item table goes into the manifest's JSON tree
(:mod:`pcframe.integrations.dcp.schema`); no ``.metadata`` pickle is written.

One rank: the version is committed when its last chunk is durable, inside ``write_data``
(DCP's ``finish`` has nothing left to add). Several ranks: each rank commits its shard in
its own ``rank-<r>`` directory, and the coordinator's ``finish`` (called by DCP only after
every rank's ``write_data`` returned) writes the global record, the commit point
(:mod:`pcframe.integrations.dcp.root`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from pcframe.config import EngineConfig
from pcframe.distributed import global_versions
from pcframe.errors import CheckpointError, ConfigError, DirectoryLocked
from pcframe.format.files import read_small
from pcframe.format.layout import Layout
from pcframe.format.manifest import is_valid_step
from pcframe.integrations.dcp import root as roots
from pcframe.integrations.dcp.schema import SCHEMA, SECTION, json_path, plain_value, tensor_record
from pcframe.save.capture import json_only
from pcframe.save.pipeline import SavePipeline
from pcframe.save.progress import SaveProgress
from pcframe.save.request import SaveRequest
from pcframe.save.status import SaveStatus
from pcframe.store.directory import LOCK, WritableCheckpointDir
from pcframe.store.retention import KeepWhere

_TRAILING_STEP = re.compile(r"(\d+)$")
# Staging buffers per writer thread: enough to keep every writer busy while the copy fills
# the next chunk, without staging a whole (possibly huge) state per save.
_BUFFERS_PER_WRITER = 2


@dataclass(frozen=True)
class PlanInfo:
    """What the coordinator decided for one rank (``SavePlan.storage_data``)."""

    version: int
    step: int
    rank: int
    world_size: int
    layout: str
    checkpoint_id: str | None
    save_id: str


class StorageWriter(_DcpStorageWriter):
    """Write ``dcp.save`` / ``dcp.async_save`` checkpoints as crash-safe pcframe versions.

    Args:
        path: the pcframe checkpoint root every save of this job goes into (each save is a
            new version). ``None``: the ``checkpoint_id`` of the save is the root.
        keep_last: committed versions kept (older ones are deleted after each commit).
        step: the training step recorded with each version; by default the trailing number
            of the save's ``checkpoint_id`` (torchtitan's ``.../step-1200`` gives 1200), else
            the version number.
        metadata: JSON-able metadata stored in every version's manifest.
        config: engine knobs (writer threads, chunk size, checksum, O_DIRECT, ...);
            keyword ``overrides`` are applied on top, e.g. ``writer_threads=8``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        keep_last: int = 3,
        step: int | None = None,
        metadata: dict[str, Any] | None = None,
        config: EngineConfig | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        if step is not None and not is_valid_step(step):
            raise ConfigError(
                f"StorageWriter(step={step!r}): a checkpoint's step is an integer in ±2**62 "
                "(another would commit a version every reader refuses)"
            )
        self.config = (config or EngineConfig()).with_overrides(keep_last=keep_last, **overrides)
        self.root = Path(path) if path is not None else None
        self.step = step
        self.metadata = json_only(metadata or {}, "metadata")
        self.checkpoint_id: str | None = None  # the current save's id (DCP logs it)
        self.last_version: int | None = None  # the newest version this writer committed
        self._rank = 0
        self._coordinator = True
        self._save_id = ""
        self._info: PlanInfo | None = None

    # --- DCP's calls, in order -------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins; ``checkpoint_id`` is its label (or the root, if none was given)."""
        self.checkpoint_id = None if checkpoint_id is None else str(checkpoint_id)
        if self.root is None and checkpoint_id is not None:
            self.root = Path(checkpoint_id)
        self._info = None

    def set_up_storage_writer(
        self,
        is_coordinator: bool,
        *args: Any,
        rank: int = 0,
        use_collectives: bool = True,
        **kwargs: Any,
    ) -> None:
        if self.root is None:
            raise ValueError(
                "pcframe StorageWriter has no directory: give StorageWriter(path) or "
                "dcp.save(..., checkpoint_id=path)"
            )
        if not use_collectives:
            raise ValueError(
                f"{self.root}: dcp.save(use_collectives=False) is not supported by pcframe's "
                "StorageWriter (every rank would commit a version of its own); use the default"
            )
        # The first that exists of the root and its parents must be a folder: a file there
        # failed the save later with a raw NotADirectoryError naming root/global.
        existing = next((p for p in (self.root, *self.root.parents) if os.path.lexists(p)), None)
        if existing is not None and not existing.is_dir():
            raise CheckpointError(
                f"StorageWriter({str(self.root)!r}): {existing} is a file, not a folder; give "
                "the path of a checkpoint folder (made if missing)"
            )
        self._coordinator, self._rank = is_coordinator, rank
        self._save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id or self.root, save_id=self._save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: one version number and layout for every rank of this save."""
        assert self.root is not None
        world = len(plans)
        version = global_versions.next_version(self.root)
        step = self.step if self.step is not None else _step_of(self.checkpoint_id, version)
        layout = roots.layout_for(self.root, world)
        self._info = PlanInfo(version, step, 0, world, layout, self.checkpoint_id, self._save_id)
        return [
            dataclasses.replace(plan, storage_data=dataclasses.replace(self._info, rank=rank))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items as one pcframe version; return when it is committed."""
        info = plan.storage_data
        if not isinstance(info, PlanInfo):
            raise CheckpointError(
                f"{self.root}: the save plan carries no pcframe storage data (a custom planner "
                "dropped SavePlan.storage_data?); keep the plan's storage_data in finish_plan"
            )
        assert self.root is not None
        tensors, tree, results = _collect(plan, planner, info)
        directory = roots.shard_dir(self.root, info.layout, info.rank)
        _commit(self.config, directory, self.root, info, tensors, tree, self.metadata)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: publish the multi-rank version (one rank: already committed)."""
        del metadata  # every rank's items are already in its manifest
        info = self._info
        assert info is not None and self.root is not None
        if len(results) != info.world_size:
            raise CheckpointError(
                f"{self.root}: {len(results)} ranks reported writes for version "
                f"{info.version}, expected {info.world_size}; not published"
            )
        if info.layout == roots.RANKS:
            roots.publish_global(
                self.root, info.version, info.step, info.world_size, self.config.keep_last
            )
        self.last_version = info.version

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A directory path (existing or not) can be a pcframe root."""
        return isinstance(checkpoint_id, str | os.PathLike) and not Path(checkpoint_id).is_file()


def _open_directory(directory: Path, version: int) -> WritableCheckpointDir:
    """Take the directory's writer lock; a save overlapping another one of ours is refused."""
    try:
        storage = WritableCheckpointDir(directory)
    except DirectoryLocked:
        try:
            holder = read_small(directory / LOCK, 64).decode(errors="replace").strip()
        except OSError:
            holder = ""
        if holder != str(os.getpid()):
            raise
        raise CheckpointError(
            f"{directory}: another save into it is still running in this process (overlapping "
            "dcp.async_save calls); wait for the previous save's future before the next one"
        ) from None
    if storage.path(version).exists():  # two overlapping saves chose the same number
        storage.close()
        raise CheckpointError(
            f"{storage.path(version)}: version {version} was committed by another save while "
            "this one was planned (overlapping dcp.async_save calls); wait for the previous "
            "save's future before the next one"
        )
    return storage


def _step_of(checkpoint_id: str | None, version: int) -> int:
    """The step a ``checkpoint_id`` ends in (``.../step-1200``), else the version number.

    Raises:
        ConfigError: the number is larger than a reader takes (the version would commit,
            every restore would refuse it, and retention would already have pruned the
            good one before it).
    """
    match = _TRAILING_STEP.search(Path(checkpoint_id).name) if checkpoint_id else None
    step = int(match.group(1)) if match else version
    if not is_valid_step(step):
        raise ConfigError(
            f"checkpoint_id={checkpoint_id!r}: its step {step} is beyond ±2**62; give "
            "StorageWriter(step=...) or an id ending in a smaller number"
        )
    return step


def _collect(
    plan: SavePlan, planner: SavePlanner, info: PlanInfo
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any], list[WriteResult]]:
    """This rank's items as named tensors, the ``dcp`` tree section and DCP's results."""
    mappings = plan.planner_data if isinstance(plan.planner_data, dict) else None
    paths = {fqn: json_path(p) for fqn, p in (mappings or {}).items()}
    tensors: list[tuple[str, torch.Tensor]] = []
    items, results, names = [], [], set()

    def name_for(fqn: str, suffix: str = "") -> str:
        # pcframe's tensor names follow the state dict's nesting ("model/layer.weight"), so
        # `pcframe export --only model` gives a state dict model.load_state_dict takes.
        base = "/".join(map(str, paths.get(fqn) or [fqn])) + suffix
        name, k = base, 1
        while name in names:
            name, k = f"{base}#{k}", k + 1
        names.add(name)
        return name

    for item in plan.items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            plain, value = plain_value(planner, item)
            if plain:
                items.append({"fqn": fqn, "kind": "value", "value": value})
                results.append(WriteResult(item.index, 0, (info.rank, len(items) - 1)))
                continue
            buffer = planner.resolve_data(item)
            raw = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
            tensors.append((name_for(fqn), raw))
            items.append({"fqn": fqn, "kind": "pickled", "data": {"$t": len(tensors) - 1}})
            results.append(WriteResult(item.index, raw.numel(), (info.rank, len(items) - 1)))
            continue
        data = item.tensor_data
        assert data is not None
        tensor = planner.resolve_data(item)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(data.chunk.sizes):
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise CheckpointError(
                f"DCP item {fqn!r}: the planner resolved {got}, its plan says a chunk of "
                f"{tuple(data.chunk.sizes)}"
            )
        whole = list(data.chunk.sizes) == list(data.size)
        suffix = "" if whole else "@" + "_".join(map(str, data.chunk.offsets))
        tensor = tensor.detach()
        if tensor.is_conj() or tensor.is_neg():
            # A lazy conjugate or negation: its bytes are not its values, and the pipeline
            # copies bytes. Materialised now, as Checkpointer's clone of a tensor it does not
            # read in place materialises it (the save's snapshot is taken here anyway).
            tensor = tensor.resolve_conj().resolve_neg()
        tensors.append((name_for(fqn, suffix), tensor))
        items.append(tensor_record(item, len(tensors) - 1))
        nbytes = tensor.numel() * tensor.element_size()
        results.append(WriteResult(item.index, nbytes, (info.rank, len(items) - 1)))
    section = {
        "schema": SCHEMA,
        "rank": info.rank,
        "world_size": info.world_size,
        "checkpoint_id": info.checkpoint_id,
        "save_id": info.save_id,
        "planner_data": {f: p for f, p in paths.items() if p is not None} if mappings else None,
        "items": items,
    }
    return tensors, {SECTION: section}, results


def _commit(
    config: EngineConfig,
    directory: Path,
    root: Path,
    info: PlanInfo,
    tensors: list[tuple[str, torch.Tensor]],
    tree: dict[str, Any],
    metadata: dict[str, Any],
) -> None:
    """Write and commit one version through the engine's pipeline (blocks until durable)."""
    layout = Layout.build(tensors, config.chunk_bytes, config.tensor_align)
    cuda_ready = None
    if any(t.is_cuda for _, t in tensors):  # the copy stage waits for the producing stream
        cuda_ready = torch.cuda.Event()
        cuda_ready.record()
    started = time.perf_counter()
    request = SaveRequest(
        version=info.version,
        step=info.step,
        layout=layout,
        tensors=tuple(t for _, t in tensors),
        tree=tree,
        numpy_tensors=(),
        metadata=metadata
        if info.checkpoint_id is None
        else {
            **metadata,
            "dcp_checkpoint_id": info.checkpoint_id,
        },
        cuda_ready=cuda_ready,
    )
    staging = _BUFFERS_PER_WRITER * config.writer_threads * config.chunk_bytes
    chunks = max(1, -(-layout.data_size // config.chunk_bytes))
    config = dataclasses.replace(config, staging_bytes=min(staging, chunks * config.chunk_bytes))
    storage = _open_directory(directory, info.version)
    try:
        keep = [KeepWhere("global records", global_versions.GlobalShards(root).keep)]
        pipeline = SavePipeline(
            config, storage, lambda _: None, keep if info.layout == roots.RANKS else []
        )
        progress = SaveProgress(info.version, info.step, layout.data_size, started)
        try:
            pipeline.submit(request, progress)
            progress.finished.wait()
        finally:
            pipeline.close()
    finally:
        storage.close()
    if progress.status is not SaveStatus.COMMITTED:
        reason = f"{progress.error}" if progress.error is not None else progress.status.value
        raise CheckpointError(
            f"{storage.path(info.version)}: version {info.version} was not committed "
            f"({progress.stage or 'commit'}: {reason}); the previous version is intact"
        ) from progress.error
