"""The background save pipeline: copy into staging, persist chunks, commit.

Threads (all started once per engine, reused by every version):

* one **copy** thread gathers each version's tensors, chunk by chunk, into buffers of the
  bounded staging pool (on a CUDA side stream for GPU tensors; kernel per
  ``copy_backend``, see :mod:`pcframe.save.copy`). Coded tensors (``codecs``) are copied raw
  into staging too, segment by segment (:mod:`pcframe.save.codec`). When every chunk and
  segment of a version is staged, its ``copy_done`` is set: the optimizer may step again.
* a pool of **writer** threads checksums and persists each staged chunk into ``data.bin``
  (``pwrite`` / O_DIRECT or a memory mapping, see :mod:`pcframe.save.persist`), and encodes each
  staged segment (the compress stage), checksums the payload and appends it to
  ``codec.bin``; then returns the buffer to the pool.
* one **commit** thread finishes versions in the order their last chunk lands: fdatasync the
  data, write and sync the manifest, publish by rename, advance LATEST, apply retention. A
  version that lands after a newer one has committed is discarded, so LATEST only moves
  forward.

A failure in any stage marks the version failed; its staging directory is removed and the
error is handed to the training thread, which raises it at its next engine call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pcframe.config import EngineConfig
from pcframe.errors import CheckpointError
from pcframe.faults import crash_point
from pcframe.format.checksum import checksum_function, format_digest
from pcframe.format.layout import Chunk, Layout
from pcframe.format.manifest import (
    CODEC_NAME,
    DATA_NAME,
    MANIFEST_NAME,
    ChunkRecord,
    DeltaLink,
    Manifest,
    SegmentRecord,
)
from pcframe.format.tree import DTYPES
from pcframe.save.codec import CodecPlan, Segment, encode_segment
from pcframe.save.copy import Copier
from pcframe.save.delta import DeltaTracker
from pcframe.save.persist import DataFile, WrittenFile, choose_persist, open_data_file, pwrite_all
from pcframe.save.staging import StagingPool
from pcframe.store.directory import WritableCheckpointDir
from pcframe.threads import single_threaded_torch

log = logging.getLogger("pcframe")

COMMITTED, DISCARDED, FAILED = "committed", "discarded", "failed"


@dataclass(eq=False)
class PendingVersion:
    """Everything the pipeline needs to write one version, plus its progress."""

    version: int
    step: int
    layout: Layout
    tensors: list[torch.Tensor]
    tree: Any
    numpy_tensors: list[int]
    metadata: dict[str, Any]
    started: float
    cuda_ready: Any = None  # torch.cuda.Event recorded on the training stream at save()
    stall: float = 0.0
    copy_done: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    status: str = ""
    stage: str = ""
    error: BaseException | None = None
    copy_seconds: float = 0.0
    # CPU seconds the engine's own threads spent on this version (copy, checksum, encode,
    # write, commit), from per-thread CPU clocks: unlike the process's CPU time it does not
    # include training, so it is precise even while training keeps every core busy.
    cpu_seconds: float = 0.0
    durable_at: float = 0.0
    checksums: list[str] = field(default_factory=list)
    o_direct: bool = False
    reported: bool = False  # its error was already raised to the user
    # Codec stage: how this version's tensors are stored, and what it wrote so far.
    plan: CodecPlan | None = None
    data_file: DataFile | None = None
    codec_file: DataFile | None = None
    codec_size: int = 0  # bytes appended to codec.bin so far
    segments: dict[int, list[SegmentRecord]] = field(default_factory=dict)
    # Delta versions (pcframe.save.delta): the base, its values, and this version's values.
    delta: DeltaLink | None = None
    delta_key: tuple = ()
    base_values: dict[int, torch.Tensor] | None = None
    new_values: dict[int, torch.Tensor] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _outstanding: int = 0
    _copy_finished: bool = False
    _handed_off: bool = False

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def nbytes(self) -> int:
        """Bytes of state this version captures (before any codec)."""
        return self.layout.data_size

    @property
    def stored_bytes(self) -> int:
        """Bytes it occupies on storage (data.bin + codec.bin), once written."""
        raw = self.plan.layout.data_size if self.plan is not None else self.nbytes
        return raw + self.codec_size

    def fail(self, stage: str, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error, self.stage = exc, stage

    def add_cpu(self, since: float) -> None:
        """Charge this thread's CPU time since ``since`` (a ``time.thread_time()``) to it."""
        spent = time.thread_time() - since
        with self._lock:
            self.cpu_seconds += spent


class SavePipeline:
    def __init__(
        self,
        config: EngineConfig,
        storage: WritableCheckpointDir,
        on_finished: Callable[[PendingVersion], None],
    ) -> None:
        self.config = config
        self.storage = storage
        self.on_finished = on_finished
        self.pool = StagingPool(config.chunk_bytes)
        self.checksum = checksum_function(config.checksum)
        self.copier = Copier(config.copy_backend, config.checksum)
        self.persist = choose_persist(storage.root, config.persist)
        self.deltas = DeltaTracker(config.full_every, storage)
        self._plan: CodecPlan | None = None  # reused while the layout is the same object
        self._plan_source: Layout | None = None
        self.max_published = max(storage.committed_versions(), default=0)
        # Called on the commit thread after a version is published: f(version, path, manifest).
        self.commit_listeners: list[Callable[[int, Path, Manifest], None]] = []
        # Each filter narrows which old versions retention may delete (ones a coordinator or
        # a slower tier still needs); all apply. The newest committed version is never deleted.
        self.retention_filters: list[Callable[[list[int]], list[int]]] = []
        # Who needs every version to be full (replica tiers copy single versions, not delta
        # chains); while this is non-empty no delta version is made.
        self.delta_blockers: list[str] = []
        self._copy_queue: queue.Queue[PendingVersion | None] = queue.Queue()
        self._commit_queue: queue.Queue[PendingVersion | None] = queue.Queue()
        self._writers = ThreadPoolExecutor(
            config.writer_threads, thread_name_prefix="pcframe-w", initializer=single_threaded_torch
        )
        self._side_stream: Any = None
        self._copy_thread = threading.Thread(
            target=self._copy_loop, name="pcframe-copy", daemon=True
        )
        self._commit_thread = threading.Thread(
            target=self._commit_loop, name="pcframe-commit", daemon=True
        )
        self._copy_thread.start()
        self._commit_thread.start()

    # --- public ------------------------------------------------------------------------

    def submit(self, pending: PendingVersion) -> None:
        self.pool.ensure(self._staging_budget(pending.nbytes), pinned=_any_cuda(pending.tensors))
        self._copy_queue.put(pending)

    def close(self) -> None:
        self._copy_queue.put(None)
        self._copy_thread.join()
        self._writers.shutdown(wait=True)
        self._commit_queue.put(None)
        self._commit_thread.join()
        self.pool.close()

    def _staging_budget(self, state_bytes: int) -> int:
        if self.config.staging_bytes is not None:
            return self.config.staging_bytes
        # Round the ratio-based budget up to whole chunks so ratio 1.0 stages a whole version.
        chunks = -(-int(state_bytes * self.config.staging_ratio) // self.config.chunk_bytes)
        return max(1, chunks) * self.config.chunk_bytes

    # --- copy stage --------------------------------------------------------------------

    def _copy_loop(self) -> None:
        single_threaded_torch()
        while (pending := self._copy_queue.get()) is not None:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                self._begin(pending)
            except BaseException as exc:
                pending.fail("persist" if pending.plan else "encode", exc)
            try:
                flats: list[torch.Tensor | None] = [None] * len(pending.tensors)
                if pending.cuda_ready is not None:
                    self._side_stream = self._side_stream or torch.cuda.Stream()
                    self._side_stream.wait_event(pending.cuda_ready)
                plan = pending.plan
                for chunk in plan.layout.chunks if plan and not pending.failed else ():
                    if pending.failed:
                        break
                    self._stage(pending, self._write_chunk, self._fill, chunk, flats)
                for segment in plan.segments if plan and not pending.failed else ():
                    if pending.failed:
                        break
                    self._stage(pending, self._encode_segment, self._fill_segment, segment, flats)
            except BaseException as exc:
                pending.fail("snapshot", exc)
            finally:
                pending.copy_seconds = time.perf_counter() - start
                pending.add_cpu(cpu)
                pending.copy_done.set()
                with pending._lock:
                    pending._copy_finished = True
                self._hand_off_if_complete(pending)

    def _begin(self, pending: PendingVersion) -> None:
        """Plan the version's storage (codecs, delta or full) and open its files."""
        if self._plan is None or self._plan_source is not pending.layout:
            self._plan = CodecPlan.build(
                pending.layout, self.config.codecs, self.config.tensor_align
            )
            self._plan_source = pending.layout
        plan = pending.plan = self._plan
        directory = self.storage.staging_path(pending.version)
        directory.mkdir()
        pending.data_file = open_data_file(
            directory / DATA_NAME, plan.layout.data_size, self.persist, self.config.o_direct
        )
        pending.o_direct = pending.data_file.direct
        pending.checksums = [""] * plan.layout.num_chunks
        if plan.segments:
            pending.codec_file = WrittenFile(directory / CODEC_NAME, 0)
            # Retention stays chain-safe under every filter (see _apply_retention); replica
            # tiers are what cannot take deltas.
            self.deltas.begin(pending, plan, blockers=self.delta_blockers)

    def _stage(
        self, pending: PendingVersion, task: Callable, fill: Callable, unit: Any, flats: list[Any]
    ) -> None:
        """Copy one chunk or segment into a staging buffer and hand it to a writer."""
        buffer = self.pool.acquire()
        try:
            fill(pending, unit, buffer, flats)
        except BaseException:
            self.pool.release(buffer)
            raise
        with pending._lock:
            pending._outstanding += 1
        self._writers.submit(task, pending, unit, buffer)

    def _flat(self, pending: PendingVersion, index: int, flats: list[Any]) -> torch.Tensor:
        """Byte view of one source tensor (made contiguous once, only if it is not)."""
        if flats[index] is None:
            tensor = pending.tensors[index]
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            flats[index] = tensor.reshape(-1).view(torch.uint8)
        return flats[index]

    def _fill(
        self, pending: PendingVersion, chunk: Chunk, buffer: torch.Tensor, flats: list[Any]
    ) -> None:
        """Stage one data.bin chunk (and, fused into the copy, its pcf64 checksum)."""
        assert pending.data_file is not None
        length = pending.data_file.write_length(chunk.length)
        pieces = [
            (self._flat(pending, p.entry, flats), p.src_start, p.dst_start, p.nbytes)
            for p in chunk.pieces
        ]
        # Fused only where the writer would hash the staged bytes itself (not on the mmap
        # path, which hashes while it copies into the mapping).
        if not self.copier.fuses_checksum or pending.data_file.checksums_on_write:
            self.copier.fill(pieces, buffer[:length], self._side_stream)
            return
        value = self.copier.fill(pieces, buffer[: chunk.length], self._side_stream, checksum=True)
        if length > chunk.length:
            buffer[chunk.length : length].zero_()  # O_DIRECT page padding
        pending.checksums[chunk.index] = format_digest(self.config.checksum, value)

    def _fill_segment(
        self, pending: PendingVersion, segment: Segment, buffer: torch.Tensor, flats: list[Any]
    ) -> None:
        """Stage one segment of a coded tensor: its raw bytes, encoded later by a writer."""
        source = self._flat(pending, segment.entry, flats)
        piece = (source, segment.start * segment.itemsize, 0, segment.nbytes)
        self.copier.fill([piece], buffer[: segment.nbytes], self._side_stream)

    # --- persist stage -----------------------------------------------------------------

    def _write_chunk(self, pending: PendingVersion, chunk: Chunk, buffer: torch.Tensor) -> None:
        cpu = time.thread_time()
        try:
            if not pending.failed:
                data_file, algo = pending.data_file, self.config.checksum
                assert data_file is not None
                digest = pending.checksums[chunk.index]  # set by a fused copy
                if digest:
                    data_file.write(chunk.offset, buffer, chunk.length, algo)
                elif data_file.checksums_on_write:
                    value = data_file.write(chunk.offset, buffer, chunk.length, algo)
                    digest = format_digest(algo, value)
                else:
                    view = memoryview(buffer.numpy()[: chunk.length])
                    digest = self.checksum([view])
                    data_file.write(chunk.offset, buffer, chunk.length, algo)
                pending.checksums[chunk.index] = digest
                crash_point("chunk_written")
        except BaseException as exc:
            pending.fail("persist", exc)
        finally:
            pending.add_cpu(cpu)
            self._done_with(pending, buffer)

    def _encode_segment(
        self, pending: PendingVersion, segment: Segment, buffer: torch.Tensor
    ) -> None:
        """The compress stage for one staged segment: encode, checksum, append to codec.bin."""
        stage, cpu = "encode", time.thread_time()
        try:
            if not pending.failed:
                plan, codec_file = pending.plan, pending.codec_file
                assert plan is not None and codec_file is not None
                entry = plan.layout.entries[segment.entry]
                dtype = DTYPES[entry.dtype]
                staged = buffer[: segment.nbytes]
                span = slice(segment.start, segment.start + segment.count)
                spec = plan.spec_for(segment.entry, pending.delta is not None)
                previous = None
                if spec.is_delta and pending.base_values is not None:
                    previous = pending.base_values[segment.entry][span]
                payload, meta = encode_segment(spec, staged, dtype, previous)
                digest = self.checksum([payload])
                stage = "persist"
                with pending._lock:
                    offset = pending.codec_size
                    pending.codec_size += len(payload)
                pwrite_all(codec_file.fd, payload, offset)  # type: ignore[attr-defined]
                if pending.new_values is not None and segment.entry in pending.new_values:
                    # This version's values: the reference of the next delta (if it commits).
                    pending.new_values[segment.entry][span].copy_(staged.view(dtype))
                record = SegmentRecord(
                    offset, len(payload), digest, segment.start, segment.count, meta
                )
                with pending._lock:
                    pending.segments.setdefault(segment.entry, []).append(record)
                crash_point("segment_written")
        except BaseException as exc:
            pending.fail(stage, exc)
        finally:
            pending.add_cpu(cpu)
            self._done_with(pending, buffer)

    def _done_with(self, pending: PendingVersion, buffer: torch.Tensor) -> None:
        self.pool.release(buffer)
        with pending._lock:
            pending._outstanding -= 1
        self._hand_off_if_complete(pending)

    def _hand_off_if_complete(self, pending: PendingVersion) -> None:
        with pending._lock:
            ready = pending._copy_finished and pending._outstanding == 0
            if not ready or pending._handed_off:
                return
            pending._handed_off = True
        self._commit_queue.put(pending)

    # --- commit stage ------------------------------------------------------------------

    def _commit_loop(self) -> None:
        single_threaded_torch()
        while (pending := self._commit_queue.get()) is not None:
            cpu = time.thread_time()
            try:
                if not pending.failed:
                    self._commit(pending)
            except BaseException as exc:
                pending.fail("commit", exc)
            finally:
                for handle in (pending.data_file, pending.codec_file):
                    if handle is not None:
                        with contextlib.suppress(OSError, BufferError):
                            handle.close()
                pending.data_file = pending.codec_file = None
                if pending.failed:
                    pending.status = FAILED
                    self.storage.discard(pending.version)
                self.deltas.finished(pending)
                pending.tensors = []  # drop references to the snapshot's sources
                pending.add_cpu(cpu)
                pending.finished.set()
                self.on_finished(pending)

    def _commit(self, pending: PendingVersion) -> None:
        if pending.version < self.max_published:
            # A newer version committed first: publishing this one would move LATEST back.
            self.storage.discard(pending.version)
            pending.status = DISCARDED
            return
        if pending.delta is not None and not self.storage.path(pending.delta.base).is_dir():
            raise CheckpointError(
                f"base version {pending.delta.base} of delta version {pending.version} is no "
                "longer committed (deleted or quarantined); the next version will be full"
            )
        plan, data_file = pending.plan, pending.data_file
        assert plan is not None and data_file is not None
        data_file.sync()
        if pending.codec_file is not None:
            pending.codec_file.sync()
        crash_point("data_synced")
        delta = pending.delta is not None
        manifest = Manifest(
            version=pending.version,
            step=pending.step,
            wall_time=time.time(),
            checksum=self.config.checksum,
            chunk_bytes=self.config.chunk_bytes,
            data_size=plan.layout.data_size,
            entries=plan.stored_entries(delta),
            chunks=[
                ChunkRecord(c.offset, c.length, pending.checksums[c.index])
                for c in plan.layout.chunks
            ],
            tree=pending.tree,
            numpy_tensors=pending.numpy_tensors,
            metadata=pending.metadata,
            engine={
                "config": self.config.to_dict(),
                "o_direct": pending.o_direct,
                "persist": self.persist,
                "stored_bytes": pending.stored_bytes,
            },
            segments={i: sorted(r, key=lambda s: s.start) for i, r in pending.segments.items()},
            codec_size=pending.codec_size,
            delta=pending.delta,
        )
        path = self.storage.staging_path(pending.version) / MANIFEST_NAME
        with open(path, "wb") as f:
            f.write(manifest.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        crash_point("manifest_written")
        self.storage.publish(pending.version)
        self.max_published = pending.version
        self.deltas.published(pending)  # before retention: see DeltaTracker.published
        pending.durable_at = time.perf_counter()
        pending.status = COMMITTED
        for listener in list(self.commit_listeners):
            try:
                listener(pending.version, self.storage.path(pending.version), manifest)
            except Exception as exc:  # a listener (e.g. an uploader) must not undo the commit
                log.warning(
                    "pcframe: commit listener failed for version %d: %s", pending.version, exc
                )
        self._apply_retention()

    def _apply_retention(self) -> None:
        versions = self.storage.committed_versions()
        doomed = versions[: -self.config.keep_last]
        for narrow in self.retention_filters:
            doomed = narrow(doomed)
        if doomed and self.config.codecs:
            # Delta chains: never delete a base that a kept or in-flight version reads.
            kept = [v for v in versions if v not in set(doomed)]
            needed = self.deltas.protected(kept)
            doomed = [v for v in doomed if v not in needed]
        for old in doomed:
            if old == versions[-1]:
                continue  # the newest committed version is never deleted
            crash_point("retention")
            try:
                self.storage.delete(old)
            except OSError as exc:  # the new version is committed; retention can retry later
                log.warning("pcframe: could not delete old checkpoint version %d: %s", old, exc)

    def deletable(self, versions: list[int]) -> list[int]:
        """The subset of ``versions`` that no kept or in-flight delta version needs.

        For code that applies retention outside the commit thread (e.g. the distributed
        engine's prune): filter its candidates through this.
        """
        if not self.config.codecs:
            return list(versions)
        doomed = set(versions)
        kept = [v for v in self.storage.committed_versions() if v not in doomed]
        needed = self.deltas.protected(kept)
        return [v for v in versions if v not in needed]


def _any_cuda(tensors: list[torch.Tensor]) -> bool:
    return any(t.is_cuda for t in tensors)
