"""The commit stage: make one fully written version durable and visible, then retain.

Order (each step synced before the next; crash points at each): fdatasync the data files,
write and fsync ``manifest.json``, publish the staging directory by rename (the commit
point) and advance LATEST (:meth:`WritableCheckpointDir.publish`), tell the delta tracker
and the commit listeners, then apply retention. A version that finishes after a newer one
was published is discarded instead, so LATEST only moves forward.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from pcframe.config import EngineConfig
from pcframe.errors import CheckpointError
from pcframe.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, ChunkRecord, Manifest
from pcframe.runtime.faults import crash_point
from pcframe.save.delta import DeltaTracker
from pcframe.save.progress import COST_KEY
from pcframe.save.status import SaveStatus
from pcframe.save.write import VersionWrite
from pcframe.store.directory import WritableCheckpointDir
from pcframe.store.retention import Retention

log = logging.getLogger("pcframe")

CommitListener = Callable[[int, Path, Manifest], None]


class Committer:
    def __init__(
        self,
        config: EngineConfig,
        storage: WritableCheckpointDir,
        deltas: DeltaTracker,
        retention: Retention,
        persist: str,
    ) -> None:
        self.config, self.storage, self.deltas = config, storage, deltas
        self.retention, self.persist = retention, persist
        self.max_published = max(storage.committed_versions(), default=0)
        # Called after a version is published: f(version, path, manifest).
        self.listeners: list[CommitListener] = []

    def any_committed(self) -> bool:
        """Whether a committed version stands in the directory now (a failed version's
        error says the last one is intact only then)."""
        try:
            return bool(self.storage.committed_versions())
        except (CheckpointError, OSError):  # unlistable now: what this engine found or published
            return self.max_published > 0

    def commit(self, write: VersionWrite) -> None:
        """Publish ``write`` (or discard it if a newer version was published first)."""
        request, progress = write.request, write.progress
        if request.version < self.max_published:
            # A newer version committed first: publishing this one would move LATEST back.
            self.storage.discard(request.version)
            progress.status = SaveStatus.DISCARDED
            return
        link = write.delta.link if write.delta is not None else None
        if link is not None and not self.storage.path(link.base).is_dir():
            raise CheckpointError(
                f"base version {link.base} of delta version {request.version} is no "
                "longer committed (deleted or quarantined); the next version will be full"
            )
        plan, data_file = write.plan, write.data_file
        assert plan is not None and data_file is not None
        data_file.sync()
        if write.codec_file is not None:
            write.codec_file.sync()
        crash_point("data_synced")
        manifest = self._manifest(write)
        body = manifest.to_bytes()
        if len(body) > MAX_MANIFEST_BYTES:  # a reader would refuse it: fail it, do not publish
            raise ValueError(
                f"the manifest of version {request.version} is {len(body)} bytes, over the "
                f"{MAX_MANIFEST_BYTES} a pcframe reader accepts: keep large values (long "
                "lists, logs) in tensors, not in the state's plain values"
            )
        path = self.storage.staging_path(request.version) / MANIFEST_NAME
        with open(path, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        crash_point("manifest_written")
        self.storage.publish(request.version)
        self.max_published = request.version
        self.deltas.published(request.version, write.delta)  # before retention: see there
        progress.durable_at = time.perf_counter()
        progress.stored_bytes = write.stored_bytes
        progress.status = SaveStatus.COMMITTED
        for listener in list(self.listeners):
            try:
                listener(request.version, self.storage.path(request.version), manifest)
            except Exception as exc:  # a listener (e.g. an uploader) must not undo the commit
                log.warning("commit listener failed for version %d: %s", request.version, exc)
        self.retention.apply()

    def _manifest(self, write: VersionWrite) -> Manifest:
        request, plan = write.request, write.plan
        assert plan is not None
        delta = write.is_delta
        return Manifest(
            version=request.version,
            step=request.step,
            wall_time=time.time(),
            checksum=self.config.checksum,
            chunk_bytes=self.config.chunk_bytes,
            data_size=plan.layout.data_size,
            entries=plan.stored_entries(delta),
            chunks=[
                ChunkRecord(c.offset, c.length, write.checksums[c.index])
                for c in plan.layout.chunks
            ],
            tree=request.tree,
            numpy_tensors=list(request.numpy_tensors),
            metadata=request.metadata,
            engine={
                "config": self.config.to_dict(),
                "o_direct": write.o_direct,
                "persist": self.persist,
                "stored_bytes": write.stored_bytes,
                # What this save cost: a policy restored from it learns it (its state was
                # taken at save(), before it knew). The time to durable is up to the data's
                # sync; the manifest's own write is a small part of it.
                COST_KEY: write.progress.cost_record(),
                # Which writer of the directory made it (Starts.unseen on restore).
                **self.storage.starts.manifest_fields(),
            },
            segments={i: sorted(r, key=lambda s: s.start) for i, r in write.segments.items()},
            codec_size=write.codec_size,
            delta=write.delta.link if write.delta is not None else None,
            stripes=write.data_file.stripes if write.data_file is not None else 1,
        )
