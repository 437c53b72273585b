"""The background save pipeline: copy into staging, persist chunks, commit.

Threads (all started once per engine, reused by every version):

* one **copy** thread gathers each version's tensors, chunk by chunk, into buffers of the
  bounded staging pool (on a CUDA side stream for GPU tensors). When it has copied every
  chunk of a version, that version's ``copy_done`` is set: the optimizer may step again.
* a pool of **writer** threads checksums and ``pwrite``\\ s each staged chunk into the
  version's data file, then returns the buffer to the pool.
* one **commit** thread finishes versions in the order their last chunk lands: fdatasync the
  data, write and sync the manifest, publish by rename, advance LATEST, apply retention. A
  version that lands after a newer one has committed is discarded, so LATEST only moves
  forward.

A failure in any stage marks the version failed; its staging directory is removed and the
error is handed to the training thread, which raises it at its next engine call.
"""

from __future__ import annotations

import contextlib
import errno
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

from pcframe.checksum import checksum_function
from pcframe.config import PAGE, EngineConfig
from pcframe.faults import crash_point
from pcframe.layout import Chunk, Layout
from pcframe.manifest import DATA_NAME, MANIFEST_NAME, ChunkRecord, Manifest
from pcframe.staging import StagingPool
from pcframe.storage import WritableCheckpointDir

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
    durable_at: float = 0.0
    checksums: list[str] = field(default_factory=list)
    fd: int = -1
    o_direct: bool = False
    reported: bool = False  # its error was already raised to the user
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _outstanding: int = 0
    _copy_finished: bool = False
    _handed_off: bool = False

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def nbytes(self) -> int:
        return self.layout.data_size

    def fail(self, stage: str, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error, self.stage = exc, stage


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
        self.max_published = max(storage.committed_versions(), default=0)
        # Called on the commit thread after a version is published: f(version, path, manifest).
        self.commit_listeners: list[Callable[[int, Path, Manifest], None]] = []
        # Narrows which old versions retention may delete (e.g. ones a coordinator or a
        # slower tier still needs); the newest committed version is never deleted anyway.
        self.retention_filter: Callable[[list[int]], list[int]] | None = None
        self._copy_queue: queue.Queue[PendingVersion | None] = queue.Queue()
        self._commit_queue: queue.Queue[PendingVersion | None] = queue.Queue()
        self._writers = ThreadPoolExecutor(config.writer_threads, thread_name_prefix="pcframe-w")
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
        while (pending := self._copy_queue.get()) is not None:
            start = time.perf_counter()
            try:
                self._open_data_file(pending)
            except BaseException as exc:
                pending.fail("persist", exc)
            try:
                flats: list[torch.Tensor | None] = [None] * len(pending.tensors)
                if pending.cuda_ready is not None:
                    self._side_stream = self._side_stream or torch.cuda.Stream()
                    self._side_stream.wait_event(pending.cuda_ready)
                for chunk in pending.layout.chunks:
                    if pending.failed:
                        break
                    buffer = self.pool.acquire()
                    try:
                        self._fill(pending, chunk, buffer, flats)
                    except BaseException:
                        self.pool.release(buffer)
                        raise
                    with pending._lock:
                        pending._outstanding += 1
                    self._writers.submit(self._write_chunk, pending, chunk, buffer)
            except BaseException as exc:
                pending.fail("snapshot", exc)
            finally:
                pending.copy_seconds = time.perf_counter() - start
                pending.copy_done.set()
                with pending._lock:
                    pending._copy_finished = True
                self._hand_off_if_complete(pending)

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
        view = buffer[: self._write_length(pending, chunk)]
        cursor, cuda = 0, False
        stream_ctx = (
            torch.cuda.stream(self._side_stream) if self._side_stream else contextlib.nullcontext()
        )
        with stream_ctx:
            for piece in chunk.pieces:
                if piece.dst_start > cursor:
                    view[cursor : piece.dst_start].zero_()  # padding: deterministic bytes
                source = self._flat(pending, piece.entry, flats)
                cuda = cuda or source.is_cuda
                view[piece.dst_start : piece.dst_start + piece.nbytes].copy_(
                    source[piece.src_start : piece.src_start + piece.nbytes], non_blocking=True
                )
                cursor = piece.dst_start + piece.nbytes
            if cursor < len(view):
                view[cursor:].zero_()
        if cuda:
            self._side_stream.synchronize()

    # --- persist stage -----------------------------------------------------------------

    def _open_data_file(self, pending: PendingVersion) -> None:
        directory = self.storage.staging_path(pending.version)
        directory.mkdir()
        path = directory / DATA_NAME
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if self.config.o_direct != "off":
            try:
                pending.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                pending.o_direct = True
            except OSError as exc:
                if self.config.o_direct == "on" or exc.errno != errno.EINVAL:
                    raise OSError(
                        exc.errno,
                        f"O_DIRECT refused by this file system ({exc.strerror}); "
                        "set engine.o_direct=auto or off",
                        str(path),
                    ) from exc
        if pending.fd < 0:
            pending.fd = os.open(path, flags, 0o644)
        padded = -(-pending.nbytes // PAGE) * PAGE
        if padded:
            # Reserve the space now: a full disk fails here, before any data is written.
            os.posix_fallocate(pending.fd, 0, padded if pending.o_direct else pending.nbytes)
        pending.checksums = [""] * pending.layout.num_chunks

    def _write_length(self, pending: PendingVersion, chunk: Chunk) -> int:
        # O_DIRECT transfers whole pages; the zero tail is cut off again before commit.
        return -(-chunk.length // PAGE) * PAGE if pending.o_direct else chunk.length

    def _write_chunk(self, pending: PendingVersion, chunk: Chunk, buffer: torch.Tensor) -> None:
        try:
            if not pending.failed:
                array = buffer.numpy()
                pending.checksums[chunk.index] = self.checksum([memoryview(array[: chunk.length])])
                data = memoryview(array[: self._write_length(pending, chunk)])
                written = 0
                while written < len(data):
                    written += os.pwrite(pending.fd, data[written:], chunk.offset + written)
                crash_point("chunk_written")
        except BaseException as exc:
            pending.fail("persist", exc)
        finally:
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
        while (pending := self._commit_queue.get()) is not None:
            try:
                if not pending.failed:
                    self._commit(pending)
            except BaseException as exc:
                pending.fail("commit", exc)
            finally:
                if pending.fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(pending.fd)
                    pending.fd = -1
                if pending.failed:
                    pending.status = FAILED
                    self.storage.discard(pending.version)
                pending.tensors = []  # drop references to the snapshot's sources
                pending.finished.set()
                self.on_finished(pending)

    def _commit(self, pending: PendingVersion) -> None:
        if pending.version < self.max_published:
            # A newer version committed first: publishing this one would move LATEST back.
            self.storage.discard(pending.version)
            pending.status = DISCARDED
            return
        if pending.o_direct:
            os.ftruncate(pending.fd, pending.nbytes)
        os.fdatasync(pending.fd)
        crash_point("data_synced")
        manifest = Manifest(
            version=pending.version,
            step=pending.step,
            wall_time=time.time(),
            checksum=self.config.checksum,
            chunk_bytes=self.config.chunk_bytes,
            data_size=pending.nbytes,
            entries=list(pending.layout.entries),
            chunks=[
                ChunkRecord(c.offset, c.length, pending.checksums[c.index])
                for c in pending.layout.chunks
            ],
            tree=pending.tree,
            numpy_tensors=pending.numpy_tensors,
            metadata=pending.metadata,
            engine={"config": self.config.to_dict(), "o_direct": pending.o_direct},
        )
        path = self.storage.staging_path(pending.version) / MANIFEST_NAME
        with open(path, "wb") as f:
            f.write(manifest.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        crash_point("manifest_written")
        self.storage.publish(pending.version)
        self.max_published = pending.version
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
        if self.retention_filter is not None:
            doomed = [v for v in self.retention_filter(doomed) if v != versions[-1]]
        for old in doomed:
            crash_point("retention")
            try:
                self.storage.delete(old)
            except OSError as exc:  # the new version is committed; retention can retry later
                log.warning("pcframe: could not delete old checkpoint version %d: %s", old, exc)


def _any_cuda(tensors: list[torch.Tensor]) -> bool:
    return any(t.is_cuda for t in tensors)
