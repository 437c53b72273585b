"""The persist stage's ways into a version's data: ``pwrite`` (optionally O_DIRECT) into one
file or several (stripes), or a mapping.

* :class:`WrittenFile`: ``pwrite`` of each staged chunk; with O_DIRECT the chunk is written
  padded to whole pages (the tail is cut off again in :meth:`WrittenFile.sync`), so page
  cache is bypassed on disks.
* :class:`MappedDataFile`: PCcheck's persistent-memory path. The file is reserved with
  ``posix_fallocate`` and mapped shared; a writer copies the staged chunk into the mapping and
  computes its checksum in the same pass (:func:`pcframe.kernels.persist_chunk_mmap`), then
  ``msync``\\ s that range. On a DAX mount (persistent memory) the stores go to the media
  without a page cache in between. On tmpfs it works too, but costs more than ``pwrite``
  (page-table setup and a fault per page: 1.3x the CPU time in
  ``experiments/results/engine_paths_cpu.md``), so ``auto`` does not pick it there.

* :class:`StripedFile`: ``pwrite`` into several files, chunk ``c`` into file
  ``c % stripes`` (:mod:`pcframe.format.stripes`): buffered writes to one file take turns on
  its lock, so on tmpfs the writers need a file each to write in parallel
  (:func:`choose_stripes`); each stripe is a :class:`WrittenFile` (O_DIRECT per
  ``o_direct``).

All reserve the whole size first, so a full disk fails before any byte is written, and all
are made durable by :meth:`DataFile.sync` (msync of everything, ``fdatasync`` of every
file) before the commit stage writes the manifest: the crash-consistency argument is the
same for each.
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import torch

from pcframe.config import PAGE
from pcframe.format.manifest import DATA_NAME
from pcframe.format.stripes import stripe_location, stripe_paths, stripe_sizes
from pcframe.store.mounts import mount_of

# File systems whose files live in the page cache alone: a buffered write is a memory copy,
# and one file's lock serializes writers (striping the data file lets them run in parallel).
PAGE_CACHE_FILE_SYSTEMS = ("tmpfs", "ramfs")
# Each stripe holds a descriptor while its version is written or read: auto stays modest.
AUTO_STRIPES_MAX = 16


def choose_stripes(directory: str | os.PathLike[str], setting: int, writers: int) -> int:
    """Files per version's data for checkpoints in ``directory`` (``setting`` 0 is auto)."""
    if setting:
        return setting
    if mount_of(directory).fs_type in PAGE_CACHE_FILE_SYSTEMS:
        return min(writers, AUTO_STRIPES_MAX)
    return 1


def choose_persist(directory: str | os.PathLike[str], setting: str) -> str:
    """``"mmap"`` or ``"write"`` for checkpoints in ``directory`` (``setting`` as configured).

    ``"auto"`` maps files on DAX mounts (persistent memory: loads and stores reach the media
    directly). Everything else gets ``write``: on disks with O_DIRECT per ``o_direct``, and on
    tmpfs too, where measured ``pwrite`` beats a mapping (no per-page faults).
    """
    if setting != "auto":
        return setting
    _, _, options = mount_of(directory)
    dax = [o for o in options.split(",") if o == "dax" or o.startswith("dax=")]
    return "mmap" if dax and dax[-1] != "dax=never" else "write"


class DataFile(ABC):
    """An open, fully reserved data file of one version, written chunk by chunk."""

    #: whether :meth:`write` computes the chunk checksum itself (in the same pass)
    checksums_on_write: bool = False
    #: whether chunks are written with O_DIRECT (recorded in the manifest's engine section)
    direct: bool = False
    #: files the chunks are spread over (recorded in the manifest: files/data.bin/stripes)
    stripes: int = 1
    #: the open descriptor of a file that keeps one (-1: none, or closed)
    fd: int = -1

    def write_length(self, length: int) -> int:
        """Bytes of the staging buffer :meth:`write` will read for a chunk of ``length``."""
        return length

    @abstractmethod
    def write(self, offset: int, buffer: torch.Tensor, length: int, algo: str) -> int | None:
        """Write ``buffer[:length]`` at ``offset``; return its checksum if computed here."""

    @abstractmethod
    def sync(self) -> None:
        """Make every written byte and the file size durable (before the manifest is written)."""

    def close(self) -> None:
        """Close the descriptor (a subclass lets go of what else it holds first)."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            finally:
                self.fd = -1


class WrittenFile(DataFile):
    """``pwrite`` into a file, with O_DIRECT per ``o_direct`` (``"off"``, ``"on"``, ``"auto"``)."""

    def __init__(self, path: Path, size: int, o_direct: str = "off") -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.size = size
        self.fd = -1
        if o_direct != "off":
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as exc:
                if o_direct == "on" or exc.errno != errno.EINVAL:
                    raise OSError(
                        exc.errno,
                        f"O_DIRECT refused by this file system ({exc.strerror}); "
                        "set engine.o_direct=auto or off",
                        str(path),
                    ) from exc
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o644)
        try:
            if size:
                # Reserve the space now: a full disk fails here, before any data is written.
                os.posix_fallocate(self.fd, 0, self.write_length(size) if self.direct else size)
        except BaseException:
            self.close()
            raise

    def write_length(self, length: int) -> int:
        # O_DIRECT transfers whole pages; the zero tail is cut off again in sync().
        return -(-length // PAGE) * PAGE if self.direct else length

    def write(self, offset: int, buffer: torch.Tensor, length: int, algo: str) -> int | None:
        data = memoryview(buffer.numpy())[: self.write_length(length)]
        pwrite_all(self.fd, data, offset)
        return None

    def sync(self) -> None:
        if self.direct:
            os.ftruncate(self.fd, self.size)
        os.fdatasync(self.fd)


class MappedDataFile(DataFile):
    """Copy chunks into a shared mapping (checksum fused into the copy), msync per chunk."""

    checksums_on_write = True

    def __init__(self, path: Path, size: int) -> None:
        from pcframe.kernels import MappedFile

        # Our own descriptor for fdatasync (MappedFile closes its one after mapping).
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.mapped = None
        try:
            self.mapped = MappedFile(path, size, create=False)
        except BaseException:
            self.close()
            raise

    def write(self, offset: int, buffer: torch.Tensor, length: int, algo: str) -> int | None:
        from pcframe.kernels import flush_mmap, persist_chunk_mmap

        assert self.mapped is not None and self.mapped.array is not None
        chunk = buffer[:length]
        if algo == "none":
            np.copyto(self.mapped.array[offset : offset + length], chunk.numpy())
            value = None
        else:
            value = persist_chunk_mmap(self.mapped, offset, chunk, algo=algo)
        # msync here, on the writer thread (ctypes releases the GIL): chunks sync in parallel
        # and the commit stage has only the file size left to sync.
        flush_mmap(self.mapped, offset, length)
        return value

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        super().close()


class StripedFile(DataFile):
    """``data.bin``'s chunks written into ``stripes`` files (:mod:`pcframe.format.stripes`):
    writers of different chunks do not take turns on one file's lock."""

    def __init__(
        self, directory: Path, size: int, chunk_bytes: int, stripes: int, o_direct: str
    ) -> None:
        self.chunk_bytes, self.stripes = chunk_bytes, stripes
        self.files: list[WrittenFile] = []
        try:
            for path, part in zip(
                stripe_paths(directory, stripes),
                stripe_sizes(size, chunk_bytes, stripes),
                strict=True,
            ):
                self.files.append(WrittenFile(path, part, o_direct))
        except BaseException:
            self.close()
            raise
        self.direct = all(f.direct for f in self.files)

    def write_length(self, length: int) -> int:
        return self.files[0].write_length(length)

    def write(self, offset: int, buffer: torch.Tensor, length: int, algo: str) -> int | None:
        stripe, local = stripe_location(offset, self.chunk_bytes, self.stripes)
        return self.files[stripe].write(local, buffer, length, algo)

    def sync(self) -> None:
        for f in self.files:
            f.sync()

    def close(self) -> None:
        errors = []
        for f in self.files:  # every stripe, even when one close fails
            try:
                f.close()
            except OSError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def open_data_file(
    directory: Path, size: int, persist: str, o_direct: str, chunk_bytes: int, stripes: int
) -> DataFile:
    """Create a version's data file(s) in ``directory``, reserved to ``size`` bytes in all,
    for the persist path ``persist`` (a mapping is one file: it has no lock to share)."""
    path = directory / DATA_NAME
    if persist == "mmap" and size > 0:  # an empty file cannot be mapped; nothing to write
        return MappedDataFile(path, size)
    if stripes > 1:
        return StripedFile(directory, size, chunk_bytes, stripes, o_direct)
    return WrittenFile(path, size, o_direct)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (handles short writes)."""
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written:], offset + written)
