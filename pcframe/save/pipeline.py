"""The background save pipeline: the threads that copy, persist and commit each version.

Threads (all started once per engine, reused by every version):

* one **copy** thread gathers each version's tensors, chunk by chunk, into buffers of the
  bounded staging pool (on a CUDA side stream for GPU tensors; kernel per
  ``copy_backend``, see :mod:`pcframe.save.copy`). Coded tensors (``codecs``) are copied raw
  into staging too, segment by segment (:mod:`pcframe.save.codec`). When every chunk and
  segment of a version is staged, its ``copy_done`` is set: the optimizer may step again.
  A training thread that has to wait for that (:meth:`SavePipeline.wait_for_copies`, the
  optimizer gate) copies host chunks of the same version meanwhile instead of idling, and
  the writers hold off (:class:`~pcframe.save.staging.StagingPool`): with nothing to
  overlap, the snapshot then runs at the memory's speed, not at one thread's.
* one **opener** thread creates each version's staging directory and data file (reserved to
  its full size) and chooses delta or full, while the copy already runs: staged chunks need
  no file, and their writers (and the commit) wait for the version's ``opened``
  (:mod:`pcframe.save.opening`). One thread, so versions open in the order they were saved.
* a pool of **writer** threads checksums and persists each staged chunk into ``data.bin``
  and encodes each staged segment, appending it to ``codec.bin``
  (:mod:`pcframe.save.write`); then returns the buffer to the pool.
* one **commit** thread finishes versions in the order their last chunk lands
  (:mod:`pcframe.save.commit`): sync, manifest, publish, LATEST, retention.
* before the first save, a short-lived **warm** thread allocates the staging pool
  (:meth:`prepare`; the others are started at the first save and reused by every version).

A failure in any stage marks the version failed; its staging directory is removed and the
error is handed to the training thread, which raises it at its next engine call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pcframe.config import EngineConfig
from pcframe.errors import SaveError, TornSnapshot
from pcframe.format.layout import Chunk
from pcframe.runtime.interrupts import interrupts_held, on_main_thread
from pcframe.runtime.threads import Bell, one_openmp_thread, single_threaded_torch
from pcframe.save.commit import CommitListener, Committer
from pcframe.save.copy import Copier, DeviceCopies, SharedChunks
from pcframe.save.delta import DeltaTracker
from pcframe.save.fill import Filler
from pcframe.save.opening import VersionOpener
from pcframe.save.persist import choose_persist
from pcframe.save.progress import SaveProgress
from pcframe.save.request import SaveRequest
from pcframe.save.staging import StagingPool
from pcframe.save.status import SaveStatus, Stage
from pcframe.save.workers import WorkerPool
from pcframe.save.write import VersionWrite, Writer
from pcframe.store.directory import WritableCheckpointDir
from pcframe.store.retention import KeepBases, KeepLast, KeepReason, Retention

log = logging.getLogger("pcframe")


class SavePipeline:
    """Copy, persist and commit threads for one checkpoint directory.

    Args:
        config: the engine's knobs.
        storage: the directory versions are written to (its writer lock is held).
        on_finished: called on the commit thread with each version's progress once it is
            committed, discarded or failed, before its ``finished`` is set (it may set it
            itself, once it has taken the version over, to wake its waiters).
        keep: reasons to keep versions beyond ``keep_last`` (replica tiers add theirs
            later: :meth:`~pcframe.store.tiers.Tiers.follow`); composed
            into the one :class:`~pcframe.store.retention.Retention` with the delta chains.
    """

    def __init__(
        self,
        config: EngineConfig,
        storage: WritableCheckpointDir,
        on_finished: Callable[[SaveProgress], None],
        keep: Sequence[KeepReason] = (),
    ) -> None:
        self.config = config
        self.storage = storage
        self.on_finished = on_finished
        self.pool = StagingPool(config.chunk_bytes)
        self.copier = Copier(config.copy_backend, config.checksum)
        self.writer = Writer(config)
        self.persist = choose_persist(storage.root, config.persist)
        self.fill = Filler(self.copier, self.persist, config.checksum)
        self.deltas = DeltaTracker(config.full_every, storage)
        self.opener = VersionOpener(config, storage, self.persist, self.deltas)
        # Delta chains are closed over even without codecs configured now: versions of an
        # earlier run may be deltas, and a kept one must keep its base.
        bases: list[KeepBases] = [self.deltas]
        self.retention = Retention(storage, [KeepLast(config.keep_last), *keep], bases)
        self.committer = Committer(config, storage, self.deltas, self.retention, self.persist)
        # Queues in C: a put is one operation, so an exception a signal handler raises on
        # the training thread around its put can never leave the queue's lock taken.
        self._copy_queue: queue.SimpleQueue[VersionWrite | None] = queue.SimpleQueue()
        self._commit_queue: queue.SimpleQueue[VersionWrite | None] = queue.SimpleQueue()
        self._writers = WorkerPool(config.writer_threads, "pcframe-w")
        # Creates each version's files (posix_fallocate of the whole data file: milliseconds)
        # while the copy thread already copies; one thread, so versions open in order.
        self._open_thread = WorkerPool(1, "pcframe-open")
        self._warming: threading.Thread | None = None  # the pool allocated ahead (prepare)
        self._sharing: SharedChunks | None = None  # the host chunks being copied now
        self._sharing_changed = threading.Condition()  # notified when _sharing is set or done
        self._copy_bell = Bell()  # rung then too: what the training thread waits on
        self._copy_thread = threading.Thread(
            target=self._copy_loop, name="pcframe-copy", daemon=True
        )
        self._commit_thread = threading.Thread(
            target=self._commit_loop, name="pcframe-commit", daemon=True
        )
        self._started = False  # the threads start with the first version (restore needs none)

    # --- public ------------------------------------------------------------------------

    @property
    def commit_listeners(self) -> list[CommitListener]:
        return self.committer.listeners

    def submit(self, request: SaveRequest, progress: SaveProgress) -> None:
        try:
            self.pool.ensure(self._staging_budget(request.nbytes), pinned=request.on_cuda)
        except MemoryError as exc:  # a save that fails, not a bad setting: training goes on
            committed = self.committer.any_committed()
            raise SaveError(request.version, progress.step, Stage.SNAPSHOT, exc, committed) from exc
        if not self._started:  # the training thread: one caller, no race
            self._started = True
            self._writers.start()
            self._open_thread.start()
            self._copy_thread.start()
            self._commit_thread.start()
        self._copy_queue.put(VersionWrite(request, progress))

    @property
    def started(self) -> bool:
        """Whether a save has been submitted (the pipeline's threads run)."""
        return self._started

    def prepare(self, footprint: Callable[[], tuple[int, bool] | None]) -> None:
        """Before the first save: allocate the staging pool (pages faulted in) on its own
        thread, which that save then does not (docs/architecture.md). ``footprint``: the
        state's ``(bytes, pinned)``, or None while unknown or unchanged since the last call.
        A failure is logged at debug level (the first save says what is wrong); a refused
        allocation is that save's."""
        if self._started:
            return
        try:  # an odd state, or no thread to be had: the first save allocates
            size = footprint()
            if size is None or (self._warming is not None and self._warming.is_alive()):
                return
            budget, pinned = self._staging_budget(size[0]), size[1]

            def warm() -> None:
                single_threaded_torch()
                with contextlib.suppress(MemoryError):
                    self.pool.ensure(budget, pinned, touch=True)

            self._warming = threading.Thread(target=warm, name="pcframe-warm", daemon=True)
            self._warming.start()
        except Exception as exc:
            log.debug("staging pool not prepared ahead of the first save: %s", exc)

    def wait_for_copies(self, progresses: Sequence[SaveProgress]) -> None:
        """Block the training thread until these versions' snapshots are copied.

        Meanwhile the writers hold off, and the training thread takes host chunks of the
        version being copied and stages them itself (a CPU that would idle copies too).

        On the main thread it waits in rounds of at most 50 ms plus a helping turn, each
        with signals held (:mod:`pcframe.runtime.interrupts`): a signal handler's exception
        (``sys.exit()``, Ctrl-C) is raised between two rounds, where this thread holds none
        of the locks the copy thread and the writers take. Raised anywhere inside, it could
        leave the staging pool's lock taken or the writers held off, and no version would
        ever finish again (the handler's own save included).
        """
        if not on_main_thread():
            self._wait_for_copies(progresses)
            return
        for progress in progresses:
            while not progress.copy_done.is_set():
                with interrupts_held(), self.pool.training_waits():
                    sharing = self._sharing  # one read: the copy thread sets and clears it
                    helped = (
                        sharing is not None
                        and sharing.write.progress is progress
                        and self._help_copy(sharing)
                    )
                    if not helped and not progress.copy_done.is_set():
                        # Not being copied yet (or by the device stream), or no chunk left to
                        # take: the copy thread rings when it starts or finishes a version.
                        self._copy_bell.wait(0.05)

    def _wait_for_copies(self, progresses: Sequence[SaveProgress]) -> None:
        with self.pool.training_waits():
            for progress in progresses:
                while not progress.copy_done.is_set():
                    with self._sharing_changed:
                        sharing = self._sharing
                        if sharing is None or sharing.write.progress is not progress:
                            # Not being copied yet (or copied by the device stream): wait for
                            # the copy thread to start it or finish it.
                            self._sharing_changed.wait(0.05)
                            continue
                    self._help_copy(sharing)
                    progress.copy_done.wait()

    def _help_copy(self, sharing: SharedChunks) -> bool:
        """Stage chunks of the version being copied; whether any was staged here."""
        cpu, staged = time.thread_time(), 0
        # One thread of its own: with the copy thread beside it, an OpenMP team here would
        # put more threads than cores on the copy (measured: twice as slow on 2 cores).
        # A failure is the version's (the copy thread meets it too and records it), not the
        # training step's; an interrupt (Ctrl-C, a signal handler raising) is the step's: the
        # chunk it cut short goes back to the copy thread and the version still commits. (An
        # engine call a handler made and was refused is raised again when the training
        # thread's engine call ends: pcframe.runtime.threads.)
        try:
            with one_openmp_thread(), contextlib.suppress(Exception):
                staged = self._copy_shared(sharing, helping=True)
        finally:
            sharing.write.progress.add_cpu(cpu)
        return staged > 0

    def close(self) -> None:
        if not self._started:
            self.pool.close()
            return
        self._copy_queue.put(None)
        self._copy_thread.join()
        self._open_thread.shutdown()
        self._writers.shutdown()
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
        while (write := self._copy_queue.get()) is not None:
            progress = write.progress
            start, cpu = time.perf_counter(), time.thread_time()
            opening = False  # the opener sets ``opened`` once it has run
            try:
                self.opener.plan(write)
                # Staged chunks need no file: their writers wait for ``opened``.
                self._open_thread.submit(self.opener.open, write)
                opening = True
            except BaseException as exc:
                progress.fail(Stage.ENCODE, exc)
            try:
                flats: list[torch.Tensor | None] = [None] * len(write.request.tensors)
                if write.request.cuda_ready is not None:
                    # On the device the tensors live on: this thread's current device is 0
                    # whatever device the training thread set.
                    device = next(t.device for t in write.request.tensors if t.is_cuda)
                    if self.fill.stream is None or self.fill.stream.device != device:
                        self.fill.stream = torch.cuda.Stream(device=device)
                    self.fill.stream.wait_event(write.request.cuda_ready)
                plan = write.plan
                if plan and not write.failed:
                    self._copy_chunks(write, plan.layout.chunks, flats)
                for segment in plan.segments if plan and not write.failed else ():
                    if write.failed:
                        break
                    self._stage(
                        write, self.writer.encode_segment, self.fill.segment, segment, flats
                    )
                if not write.failed and (torn := write.request.torn_tensors()):
                    progress.fail(Stage.SNAPSHOT, TornSnapshot(write.version, torn))
            except BaseException as exc:
                progress.fail(Stage.SNAPSHOT, exc)
            finally:
                if not opening:  # no writer may wait for files this version never opens
                    write.opened.set()
                progress.copy_seconds = time.perf_counter() - start
                progress.add_cpu(cpu)
                progress.copy_done.set()
                self._copy_bell.ring()  # a training thread waiting for it
                with self._sharing_changed:
                    self._sharing_changed.notify_all()
                if write.copy_finished():
                    self._commit_queue.put(write)

    def _copy_chunks(self, write: VersionWrite, chunks: list[Chunk], flats: list[Any]) -> None:
        """Stage every data.bin chunk; a waiting training thread may take some of them."""
        if write.request.cuda_ready is not None or not self.copier.shareable:
            # Device copies (one stream) and the Triton interpreter: one thread.
            self._stage_chunks(write, chunks, flats)
            return
        sharing = SharedChunks(write, chunks, flats)
        with self._sharing_changed:
            self._sharing = sharing
            self._sharing_changed.notify_all()
        self._copy_bell.ring()
        try:
            self._copy_shared(sharing)
        finally:
            with self._sharing_changed:
                self._sharing = None
            # A chunk the training thread took is staged before copy_done; one it gave back
            # (interrupted) after this thread's last take is staged here.
            leftovers = sharing.finish()
        self._stage_chunks(write, leftovers, flats)

    def _stage_chunks(self, write: VersionWrite, chunks: list[Chunk], flats: list[Any]) -> None:
        if write.request.cuda_ready is not None and not self.copier.device_kernel:
            self._stage_device_chunks(write, chunks, flats)
            return
        for chunk in chunks:
            if write.failed:
                break
            self._stage(write, self.writer.write_chunk, self.fill.chunk, chunk, flats)

    def _stage_device_chunks(
        self, write: VersionWrite, chunks: list[Chunk], flats: list[Any]
    ) -> None:
        """The torch copy of a CUDA state: a few chunks queued ahead on the side stream."""

        enqueue = functools.partial(self.fill.device_chunk, write, flats=flats)
        hand_off = functools.partial(self._hand_off, write, self.writer.write_chunk)
        DeviceCopies(self.pool, hand_off).stage(chunks, enqueue, lambda: write.failed)

    def _copy_shared(self, sharing: SharedChunks, *, helping: bool = False) -> int:
        """Stage chunks of ``sharing`` until none is left; how many were staged here."""
        write, staged = sharing.write, 0
        while not write.failed and (chunk := sharing.take()) is not None:
            handed = False
            try:
                # The helping training thread never waits for a buffer (a writer to free
                # one): it gives the chunk back and goes back to waiting, where a signal
                # can reach it.
                buffer = self.pool.try_acquire() if helping else self.pool.acquire()
                if buffer is None:
                    break
                self._fill_and_hand_off(
                    write, self.writer.write_chunk, self.fill.chunk, chunk, sharing.flats, buffer
                )
                handed = True
                staged += 1
            except BaseException as exc:
                # The copy thread's failure is the version's. The helping training thread's
                # need not be: a signal handler runs on it and may raise anything between
                # two bytecodes (a refused engine call, Ctrl-C). Its chunk goes back to the
                # copy thread, whose own attempt fails the version if the copy itself fails.
                if not helping:
                    write.progress.fail(Stage.SNAPSHOT, exc)
                raise
            finally:
                # A chunk the helping training thread did not hand to a writer (it was
                # interrupted) is staged by the copy thread after all.
                sharing.done(None if handed or write.failed else chunk)
        return staged

    def _stage(
        self, write: VersionWrite, task: Callable, fill: Callable, unit: Any, flats: list[Any]
    ) -> None:
        """Copy one chunk or segment into a staging buffer and hand it to a writer."""
        self._fill_and_hand_off(write, task, fill, unit, flats, self.pool.acquire())

    def _fill_and_hand_off(
        self,
        write: VersionWrite,
        task: Callable,
        fill: Callable,
        unit: Any,
        flats: list[Any],
        buffer: Any,
    ) -> None:
        try:
            fill(write, unit, buffer, flats)
        except BaseException:
            self.pool.release(buffer)
            raise
        self._hand_off(write, task, unit, buffer)

    def _hand_off(self, write: VersionWrite, task: Callable, unit: Any, buffer: Any) -> None:
        """A staged chunk or segment goes to a writer (which releases its buffer)."""
        write.staged()
        self._writers.submit(self._run_writer, task, write, unit, buffer)

    def _run_writer(self, task: Callable, write: VersionWrite, unit: Any, buffer: Any) -> None:
        holds = None
        try:
            self.pool.writer_turn()  # the copy first while training waits for it
            write.opened.wait()  # set by the opener thread
            task(write, unit, buffer)
            if task == self.writer.write_chunk and not write.failed:  # written as it is
                holds = (write.version, unit.index)
        finally:
            self.pool.release(buffer, holds)
            if write.done_one():
                self._commit_queue.put(write)

    # --- commit stage ------------------------------------------------------------------

    def _commit_loop(self) -> None:
        single_threaded_torch()
        while (write := self._commit_queue.get()) is not None:
            write.opened.wait()  # a version without chunks has had no writer wait for it
            progress, cpu = write.progress, time.thread_time()
            try:
                if not write.failed:
                    self.committer.commit(write)
            except BaseException as exc:
                progress.fail(Stage.COMMIT, exc)
            finally:
                for handle in (write.data_file, write.codec_file):
                    if handle is not None:
                        with contextlib.suppress(OSError, BufferError):
                            handle.close()
                write.data_file = write.codec_file = None
                if write.failed:
                    progress.status = SaveStatus.FAILED
                    self.storage.discard(write.version)
                    progress.committed_before = self.committer.any_committed()
                self.deltas.finished(write.version, write.delta)
                progress.add_cpu(cpu)
                # Handed over before ``finished`` is set: a wait() that sees the version
                # finished then finds it handed over too, and raises its failure. (Set
                # after, a wait() could return in between without raising it.)
                try:
                    self.on_finished(progress)
                finally:
                    progress.finished.set()
