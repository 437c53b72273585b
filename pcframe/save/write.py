"""The persist and compress stages: one staged chunk or segment, written by a writer thread.

:class:`VersionWrite` is the pipeline's own record of one version being written (its
request, its progress, its open files, what was written so far); no other module writes it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pcframe.config import EngineConfig
from pcframe.format.checksum import checksum_function, format_digest
from pcframe.format.layout import Chunk
from pcframe.format.manifest import SegmentRecord
from pcframe.format.tree import DTYPES
from pcframe.runtime.faults import crash_point
from pcframe.save.codec import CodecPlan, Segment, encode_segment
from pcframe.save.delta import DeltaChoice
from pcframe.save.persist import DataFile, pwrite_all
from pcframe.save.progress import SaveProgress
from pcframe.save.request import SaveRequest
from pcframe.save.status import Stage


@dataclass(eq=False)
class VersionWrite:
    """One version on its way through the pipeline (owned by the pipeline's threads)."""

    request: SaveRequest
    progress: SaveProgress
    plan: CodecPlan | None = None
    data_file: DataFile | None = None
    codec_file: DataFile | None = None
    codec_size: int = 0  # bytes appended to codec.bin so far
    segments: dict[int, list[SegmentRecord]] = field(default_factory=dict)
    checksums: list[str] = field(default_factory=list)  # per data.bin chunk
    o_direct: bool = False
    delta: DeltaChoice | None = None
    # Where each tensor's bytes start, for the host copy kernel (-1: not readable so).
    host_addresses: np.ndarray | None = field(default=None, repr=False)
    # Set once its files are open (or opening failed): the copy starts before, the writers
    # wait for it.
    opened: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _outstanding: int = 0  # chunks and segments handed to writers, not yet done
    _copy_finished: bool = False
    _handed_off: bool = False

    @property
    def version(self) -> int:
        return self.request.version

    @property
    def failed(self) -> bool:
        return self.progress.failed

    @property
    def is_delta(self) -> bool:
        return self.delta is not None and self.delta.link is not None

    @property
    def stored_bytes(self) -> int:
        """Bytes it occupies on storage (data.bin + codec.bin), once written."""
        raw = self.plan.layout.data_size if self.plan is not None else self.request.nbytes
        return raw + self.codec_size

    def staged(self) -> None:
        """One more chunk or segment handed to a writer."""
        with self._lock:
            self._outstanding += 1

    def done_one(self) -> bool:
        """A writer finished one; True when the whole version is ready to commit."""
        with self._lock:
            self._outstanding -= 1
        return self._take_hand_off()

    def copy_finished(self) -> bool:
        """The copy stage is through; True when the whole version is ready to commit."""
        with self._lock:
            self._copy_finished = True
        return self._take_hand_off()

    def _take_hand_off(self) -> bool:
        with self._lock:
            ready = self._copy_finished and self._outstanding == 0
            if not ready or self._handed_off:
                return False
            self._handed_off = True
            return True


class Writer:
    """The work a writer thread does on one staged buffer (the buffer is not released here)."""

    def __init__(self, config: EngineConfig) -> None:
        self.algo = config.checksum
        self.checksum = checksum_function(config.checksum)

    def write_chunk(self, write: VersionWrite, chunk: Chunk, buffer: torch.Tensor) -> None:
        """Persist stage: checksum one staged data.bin chunk (unless fused) and write it."""
        cpu = time.thread_time()
        try:
            if not write.failed:
                data_file = write.data_file
                assert data_file is not None
                digest = write.checksums[chunk.index]  # set by a fused copy
                if digest:
                    data_file.write(chunk.offset, buffer, chunk.length, self.algo)
                elif data_file.checksums_on_write:
                    value = data_file.write(chunk.offset, buffer, chunk.length, self.algo)
                    digest = format_digest(self.algo, value)
                else:
                    view = memoryview(buffer.numpy()[: chunk.length])
                    digest = self.checksum([view])
                    data_file.write(chunk.offset, buffer, chunk.length, self.algo)
                write.checksums[chunk.index] = digest
                crash_point("chunk_written")
        except BaseException as exc:
            write.progress.fail(Stage.PERSIST, exc)
        finally:
            write.progress.add_cpu(cpu)

    def encode_segment(self, write: VersionWrite, segment: Segment, buffer: torch.Tensor) -> None:
        """Compress stage for one staged segment: encode, checksum, append to codec.bin."""
        stage, cpu = Stage.ENCODE, time.thread_time()
        try:
            if not write.failed:
                plan, codec_file, delta = write.plan, write.codec_file, write.delta
                assert plan is not None and codec_file is not None
                entry = plan.layout.entries[segment.entry]
                dtype = DTYPES[entry.dtype]
                staged = buffer[: segment.nbytes]
                span = slice(segment.start, segment.start + segment.count)
                spec = plan.spec_for(segment.entry, write.is_delta)
                previous = None
                if spec.is_delta and delta is not None and delta.base_values is not None:
                    previous = delta.base_values[segment.entry][span]
                try:
                    payload, meta = encode_segment(spec, staged, dtype, previous)
                except ValueError as exc:  # the codec's words, plus which tensor and where
                    raise ValueError(
                        f"tensor {entry.name!r} (the segment from element {segment.start}), "
                        f"codec {spec.name!r}: {exc}; match it with a lossless codec (or "
                        "none) in engine.codecs"
                    ) from exc
                digest = self.checksum([payload])
                stage = Stage.PERSIST
                with write._lock:
                    offset = write.codec_size
                    write.codec_size += len(payload)
                pwrite_all(codec_file.fd, payload, offset)  # type: ignore[attr-defined]
                if delta is not None and segment.entry in delta.new_values:
                    # This version's values: the reference of the next delta (if it commits).
                    delta.new_values[segment.entry][span].copy_(staged.view(dtype))
                record = SegmentRecord(
                    offset, len(payload), digest, segment.start, segment.count, meta
                )
                with write._lock:
                    write.segments.setdefault(segment.entry, []).append(record)
                crash_point("segment_written")
        except BaseException as exc:
            write.progress.fail(stage, exc)
        finally:
            write.progress.add_cpu(cpu)
