"""A replica tier in a local directory (a second disk, a network mount, or tmpfs).

It reuses the engine's directory protocol (:class:`~pcframe.store.directory.WritableCheckpointDir`):
a version is copied into ``vNNNNNNNN.tmp/``, every file is fsynced, then the directory is
synced and renamed to ``vNNNNNNNN`` (the commit point) and the parent synced; LATEST follows.
Deletes go through a ``.trash-`` rename. So the replica is itself a valid checkpoint directory
that ``pcframe list``/``verify`` and a ``Checkpointer`` pointed at it can read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from pcframe.errors import CheckpointError, TierCancelled, TierError
from pcframe.format.manifest import manifest_crc, read_manifest
from pcframe.format.names import MANIFEST_NAME
from pcframe.format.pieces import verify_files
from pcframe.runtime.faults import crash_point
from pcframe.store.directory import WritableCheckpointDir
from pcframe.store.tiers.base import Tier, version_files

_PIECE = 64 * 1024 * 1024  # bytes per copy call: the granularity at which a copy can be cancelled


class LocalTier(Tier):
    """A checkpoint directory on this machine, written by copying committed versions.

    Args:
        path: the directory (created if missing). One writer process per directory: the
            tier takes the directory's writer lock at first use (when its Checkpointer starts,
            which also removes leftovers of an interrupted copy) and holds it until
            :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._opened: WritableCheckpointDir | None = None
        self._cancel = threading.Event()

    @property
    def _dir(self) -> WritableCheckpointDir:
        if self._opened is None:
            try:
                self._opened = WritableCheckpointDir(self.path)
            except CheckpointError as exc:
                raise TierError(f"tier {self.name!r} at {self.path}: {exc}") from exc
        return self._opened

    @property
    def removed_leftovers(self) -> list[str]:
        """Half-copied versions of an earlier, interrupted writer removed when it was opened."""
        return self._dir.removed_leftovers

    @property
    def location(self) -> str:
        return str(self.path)

    def committed_versions(self) -> list[int]:
        try:
            return self._dir.committed_versions()
        except OSError as exc:
            raise TierError(f"tier {self.name!r} ({self.path}): cannot list: {exc}") from exc

    def write(self, version: int, source: Path, step: int | None = None) -> int:
        del step  # the manifest inside the copied directory records it
        self._cancel.clear()
        staging = self._dir.staging_path(version)
        shutil.rmtree(staging, ignore_errors=True)  # an earlier failed attempt of this version
        written = 0
        try:
            staging.mkdir()
            for src in version_files(source):
                written += self._copy_file(src, staging / src.name)
            # Every piece checked before the copy counts (and retention here deletes older
            # copies for it): a byte damaged in the source since its commit (a memory tier's
            # pages) or by the copy is a failed write, never a replica.
            verify_files(staging, read_manifest(str(staging / MANIFEST_NAME)))
            crash_point("replica_copied")
            self._dir.publish(version)  # fsync dir, rename (commit point), fsync parent, LATEST
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return written

    def _copy_file(self, src: Path, dst: Path) -> int:
        """Copy in pieces (in-kernel where possible), then fsync: durable before publish."""
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            size = os.fstat(fin.fileno()).st_size
            offset = 0
            while offset < size:
                if self._cancel.is_set():
                    raise TierCancelled(f"copy of {src} to tier {self.name!r} cancelled")
                want = min(_PIECE, size - offset)
                try:
                    done = os.copy_file_range(fin.fileno(), fout.fileno(), want, offset, offset)
                except OSError:  # e.g. across some file systems: fall back to a plain copy
                    # At the piece's offset: copy_file_range moved neither file's position.
                    done = os.pwrite(fout.fileno(), os.pread(fin.fileno(), want, offset), offset)
                if done == 0:
                    raise TierError(f"{src} shrank while being copied to tier {self.name!r}")
                offset += done
            os.fsync(fout.fileno())
        return size

    def delete(self, version: int) -> None:
        self._dir.delete(version)

    @contextlib.contextmanager
    def _here(self, version: int) -> Iterator[Path]:
        yield self._dir.path(version)

    def fetch(self, version: int, scratch: Path) -> contextlib.AbstractContextManager[Path]:
        del scratch  # already local: read in place
        return self._here(version)

    def manifest_crc(self, version: int) -> str:
        return manifest_crc(self._dir.path(version) / MANIFEST_NAME)

    def quarantine(self, version: int, reason: str = "") -> None:
        self._dir.quarantine(version, reason)

    def cancel(self) -> None:
        self._cancel.set()

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None
