"""A checkpoint directory on a local (or memory) file system: naming, durability, publish.

Layout::

    root/
      .writer.lock          flock held by the one process that writes here
      .clean-exit           present while no writer runs, if the last one closed cleanly
      .starts               writer count: numbers each Checkpointer (pcframe.store.starts)
      LATEST                newest committed version (a hint, never ahead of the directories)
      v00000012/            a committed version: manifest.json + data.bin (+ its stripes)
      v00000013.tmp/        a version being written; removed on the next start
      .trash-v00000009/     a version being deleted by retention

The commit point of a version is the rename of ``vNNNNNNNN.tmp`` to ``vNNNNNNNN`` after its
data and manifest were synced; listing therefore never sees a half-written version.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import sys
import weakref
from pathlib import Path

from pcframe.errors import CheckpointError, DirectoryLocked, NotRegularFile, RestoreIOError
from pcframe.format.files import is_real_directory, open_regular, read_small
from pcframe.format.manifest import FORMAT as MANIFEST_FORMAT
from pcframe.format.manifest import MANIFEST_HEAD, read_manifest
from pcframe.format.names import MANIFEST_NAME, version_name, version_number
from pcframe.runtime.faults import crash_point
from pcframe.runtime.processes import process_alive
from pcframe.store.starts import Starts, count_start

log = logging.getLogger("pcframe")
_LATEST_LIMIT = 64  # bytes: "v" + at most 13 digits + newline, with room to spare
_warned_links: set[str] = set()

LATEST = "LATEST"
LOCK = ".writer.lock"
CLEAN_EXIT = ".clean-exit"
# Prefixes of a version folder (or global record) moved out of the listing: one being
# deleted by retention, one a restore set aside as damaged (kept for inspection).
TRASH_PREFIX = ".trash-"
QUARANTINE_PREFIX = ".corrupt-"
SET_ASIDE_NAME = "set-aside.txt"  # in a quarantined version: why a restore set it aside
# What a writer that died may leave at the top of its folder, and the next one removes: a
# version being written or deleted, a tier's fetch scratch, a marker being replaced. Only
# these: anything else in the folder is the user's (notes.tmp, .trash-me) and stays.
_LEFTOVER = re.compile(
    rf"^(v\d{{8,}}\.tmp|{re.escape(TRASH_PREFIX)}v\d{{8,}}|\.fetch-v\d{{8,}}-.+\.tmp"
    r"|(LATEST|\.clean-exit|\.starts)\.tmp)$"
)

# Every writer holding its lock in this process. A child forked without exec (a DataLoader
# worker, a multiprocessing helper) would inherit the lock's open file and with it the
# flock, so a restart after the writer died would find the directory locked for as long
# as the child lived: the child closes its copies at once (the parent's lock is unchanged).
_HOLDERS: weakref.WeakSet[WritableCheckpointDir] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    for holder in list(_HOLDERS):
        with contextlib.suppress(OSError):
            os.close(holder._lock_fd)
        holder._lock_fd = -1
    _HOLDERS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary name, fsync it, rename, fsync the directory.

    The temporary file is created fresh (a leftover, or a link planted under its name, is
    unlinked first, never written through), so nothing outside the directory is touched.
    """
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def is_leftover_name(name: str) -> bool:
    """Whether a writer removes ``name`` at the top of its folder when it opens."""
    return bool(_LEFTOVER.match(name))


def write_new_file(path: Path, data: bytes) -> None:
    """Write ``data`` into a new file at ``path``: whatever has the name (a link, a hard
    link, a FIFO planted in a damaged version) is unlinked first, never written through."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


class CheckpointDir:
    """Read-side view of a checkpoint directory (no lock needed, never modifies)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        if not isinstance(root, str | os.PathLike):
            raise TypeError(
                f"the checkpoint directory is a {type(root).__name__} ({root!r}): give a path, "
                "a str or a pathlib.Path"
            )
        if not os.fspath(root):  # Path("") is the working directory: never meant
            raise CheckpointError(
                "the checkpoint directory is an empty path: give a folder ('.' for the "
                "working directory)"
            )
        # Absolute now: a relative folder resolved at each call against the working
        # directory of the moment, so an os.chdir() after opening sent the saves, and
        # retention's deletes, into whatever folder of that name the new directory held
        # (another run's checkpoints, unlocked).
        self.root = Path(root).absolute()
        # Linux's limits: a name of 255 bytes, a path of 4096 (with room for a version's
        # files below it). Beyond them every call fails with a raw ENAMETOOLONG.
        encoded = os.fsencode(self.root)
        if len(encoded) > 4000 or any(len(part) > 255 for part in encoded.split(b"/")):
            raise CheckpointError(
                f"the checkpoint directory {str(self.root)[:80]}... is too long a path (a "
                "name is at most 255 bytes, a path about 4000): give a shorter one"
            )

    def path(self, version: int) -> Path:
        return self.root / version_name(version)

    def committed_versions(self) -> list[int]:
        """Committed versions, oldest first.

        A version directory that is a symbolic link is not listed (with a warning): pcframe
        never reads or deletes through links; numbers above ``MAX_VERSION`` are ignored.
        """
        if not self.root.is_dir():
            return []
        try:
            names = os.listdir(self.root)
        except OSError as exc:  # unreadable (permissions, storage): not "no checkpoint"
            raise RestoreIOError(
                f"cannot list {self.root}: {exc.strerror or exc}; fix its permissions or the "
                "storage, then retry (nothing was read or changed)"
            ) from None
        found = []
        for name in names:
            version = version_number(name, str(self.root / name))
            if version is None:
                continue
            path = self.root / name
            if is_real_directory(path):
                found.append(version)
            elif path.is_symlink() and str(path) not in _warned_links:
                _warned_links.add(str(path))
                log.warning(
                    "ignoring %s: a version directory must not be a symbolic link "
                    "(move the version itself into %s)",
                    path,
                    self.root,
                )
        return sorted(found)

    def step_of(self, version: int) -> int:
        """The training step committed ``version`` holds (its manifest read and checked).

        Raises:
            CheckpointError: the manifest cannot be read or is damaged (naming it).
        """
        path = self.path(version) / MANIFEST_NAME
        try:
            return read_manifest(str(path)).step
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None

    def taken_versions(self) -> list[int]:
        """The committed versions and the numbers of anything else named like one (a stray
        file or link): not versions, but the rename that publishes a version must not land
        on them, so new numbers go above them too."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        taken = (version_number(name, str(self.root / name)) for name in names)
        return sorted(v for v in taken if v is not None)

    def latest_hint(self) -> int | None:
        """The version LATEST names, or ``None``: it is only a hint, the listing decides.

        LATEST is read as a bounded hint: a regular file only (opened without following
        links, without blocking), at most 64 bytes, ASCII. Anything else is ignored with
        a warning.
        """
        path = self.root / LATEST
        try:
            raw = read_small(path, _LATEST_LIMIT)
        except FileNotFoundError:
            return None
        except (OSError, NotRegularFile) as exc:
            log.warning("ignoring %s (%s); the directory listing decides", path, exc)
            return None
        try:
            text = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            text = None
        version = version_number(text, str(path)) if text else None
        if version is None and raw.strip():
            log.warning(
                "ignoring %s: %r does not name a version; the directory listing decides",
                path,
                raw[:32],
            )
        return version


def set_aside(root: Path, version: int, reason: str = "") -> bool:
    """Move ``root``'s version that failed verification out of the listing, keeping its files
    and, beside them, why (``set-aside.txt``: read by ``pcframe list`` and ``verify``).

    Returns whether it is out of the listing (``False``: the rename failed, it stays listed).
    """
    target = root / f"{QUARANTINE_PREFIX}{version_name(version)}-{os.getpid()}"
    source = root / version_name(version)
    try:
        os.rename(source, target)
        fsync_dir(root)
    except FileNotFoundError:
        return True  # already gone (a live writer's retention)
    except OSError as exc:
        # Read-only or not ours to rename: it stays listed, which nobody would know.
        log.warning(
            "could not set damaged checkpoint version %d aside (%s): it stays listed and is "
            "read and skipped again at each restore (this writer's keep_last does not count "
            "it); move %s out of %s",
            version,
            exc.strerror or exc,
            source,
            root,
        )
        return False
    if reason:  # best effort: the version is out of the listing whether or not this lands
        with contextlib.suppress(OSError):
            write_new_file(target / SET_ASIDE_NAME, f"{reason}\n".encode())
    return True


def quarantined_versions(root: Path) -> list[str]:
    """The versions a restore set aside as damaged (``.corrupt-v…``, kept for inspection)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(name for name in names if name.startswith(f"{QUARANTINE_PREFIX}v"))


def set_aside_reason(folder: Path) -> str:
    """Why a restore set ``folder`` (a ``.corrupt-v…`` version) aside, as it recorded it;
    ``"reason not recorded"`` for one set aside by a pcframe that did not record it."""
    try:
        return read_small(folder / SET_ASIDE_NAME, 64 * 1024).decode(errors="replace").strip()
    except (OSError, NotRegularFile):
        return "reason not recorded"


def _caller_outside_pcframe() -> str:
    """``file:line`` of the innermost frame outside pcframe (who opened a writer)."""
    package = str(Path(__file__).resolve().parents[1]) + os.sep
    frame = sys._getframe(1)
    while frame is not None and os.path.realpath(frame.f_code.co_filename).startswith(package):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _locked_message(root: Path, holder: str) -> str:
    """Why ``root``'s lock is taken, in words: who holds it and what to do."""
    pid = int(holder) if holder.isdigit() else None
    if pid == os.getpid():
        opened = [h.opened_at for h in list(_HOLDERS) if _same_folder(h.root, root)]
        where = f" (opened at {opened[0]})" if opened else ""
        return (
            f"{root} already has a Checkpointer open in this process{where}; only one "
            "writer per directory: call close() on that one first (in a notebook, the "
            "variable of the cell that opened it still holds it; `with Checkpointer(...)` "
            "closes by itself), or use another directory"
        )
    if pid is not None and not process_alive(pid):
        return (
            f"{root} is locked, but its last writer (pid {pid}) has exited: a process it "
            "started still holds the lock (one started by a pcframe older than this one, "
            "or by fork through C code); stop that process, then retry"
        )
    return (
        f"{root} is being written by another live process (pid {holder or '?'}); only one "
        "writer per directory: close the other Checkpointer or use another directory"
    )


def held_lock(root: Path) -> str | None:
    """Why ``root``'s writer lock is taken, in the words a writer opening it would get, or
    ``None``: it is free, or that cannot be told here.

    Read from Linux's ``/proc/locks``, without taking the lock: a probe that took it, even
    for a moment, could make the other writer's own open fail. Without ``/proc`` (another
    OS) this is ``None``, and the writer's open is where a taken lock is found.
    """
    try:
        info = os.stat(root / LOCK, follow_symlinks=False)
        with open("/proc/locks") as locks:
            lines = locks.read().splitlines()
    except OSError:  # no lock file (nothing can hold it), or no /proc/locks
        return None
    # "1: FLOCK  ADVISORY  WRITE <pid> <major>:<minor>:<inode> 0 EOF"; a waiter has "->".
    key = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    for fields in map(str.split, lines):
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == key:
            pid = fields[4]  # the one that took it; 0: in another pid namespace, unknown
            return _locked_message(root, "" if pid == "0" else pid)
    return None


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def refuse_version_folder(root: Path, pick: str) -> None:
    """Refuse ``root`` when it is the folder of one version (it holds a manifest): nothing
    there is listed as a version, so a restore found "no checkpoint" and started afresh,
    and a writer put its lock and marks into the committed version's folder. A file of the
    user's own of that name (a dataset's manifest.json) is no version's: its header tells.
    ``pick``: how the caller picks one version, ``{}`` standing for its number."""
    try:
        head = read_small(root / MANIFEST_NAME, MANIFEST_HEAD)
    except (OSError, NotRegularFile):
        return
    if f'"{MANIFEST_FORMAT}"'.encode() in head.partition(b"\n")[0]:
        number = version_number(root.name)
        how = f" ({pick.format(number)})" if number is not None else ""
        raise CheckpointError(
            f"{root} is the folder of one version; give its parent, {root.parent}, the "
            f"checkpoint directory{how}"
        )


class WritableCheckpointDir(CheckpointDir):
    """Write side: holds the writer lock, creates, publishes and deletes versions."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        # before anything is written in it
        refuse_version_folder(self.root, "restore(version={}) picks this one")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_fd = open_regular(self.root / LOCK, os.O_RDWR | os.O_CREAT)
        except NotRegularFile as exc:
            raise CheckpointError(
                f"cannot lock {self.root}: {exc} (pcframe writes only its own lock file there)"
            ) from None
        except OSError as exc:
            if os.path.islink(self.root) and not self.root.exists():  # e.g. /dev/shm wiped
                raise CheckpointError(
                    f"cannot write checkpoints to {self.root}: it is a link to "
                    f"{os.readlink(self.root)}, which does not exist (a RAM folder gone with "
                    "a reboot?); make that folder, or point the link somewhere that exists"
                ) from exc
            raise CheckpointError(
                f"cannot write checkpoints to {self.root}: {exc.strerror} ({exc.filename}); "
                "choose a writable directory or fix its permissions"
            ) from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 64, 0).decode(errors="replace").strip()
            os.close(self._lock_fd)
            raise DirectoryLocked(_locked_message(self.root, holder)) from None
        self.opened_at = _caller_outside_pcframe()  # before it is listed: a message reads it
        _HOLDERS.add(self)
        try:
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
            self.removed_leftovers = self._remove_leftovers()
            self.previous_exit_clean = self._take_clean_exit()
            self.starts = Starts()  # not counted until count_start()
            # Versions a restore found damaged but could not set aside: still listed, they
            # must not count as kept versions (retention would prune a good one for them).
            self.damaged: set[int] = set()
        except OSError as exc:  # release the lock: this process must be able to retry
            self.close()
            raise CheckpointError(
                f"cannot open {self.root} for writing: {exc.strerror or exc} "
                f"({exc.filename or self.root}); check the storage, then retry"
            ) from exc

    def _take_clean_exit(self) -> bool:
        """Whether the previous writer closed cleanly; the mark is removed (durably) at once.

        So if this writer is then killed or preempted, the next one does not see a mark.
        """
        path = self.root / CLEAN_EXIT
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except IsADirectoryError:  # not ours: a clean exit is never a directory
            log.warning("ignoring %s: a directory, not pcframe's clean-exit mark", path)
            return False
        fsync_dir(self.root)
        return True

    def count_start(self) -> Starts:
        """Number this writer (:mod:`pcframe.store.starts`): called by the ``Checkpointer``
        once it is fully built, so a failed construction is not counted as a death, and a
        tier replica or a DCP save that opens a directory is not counted at all."""
        self.starts = count_start(self.root, self.previous_exit_clean, write_file_durably)
        return self.starts

    def mark_clean_exit(self) -> None:
        """Record that this writer is closing normally (called last, under the lock)."""
        write_file_durably(self.root / CLEAN_EXIT, f"{os.getpid()}\n".encode())

    def abandon(self) -> None:
        """Release the directory of a writer that never ran (its construction failed), as
        it was found: a clean mark the previous writer left stays."""
        if self.previous_exit_clean:
            with contextlib.suppress(OSError):
                self.mark_clean_exit()
        self.close()

    def close(self) -> None:
        if self._lock_fd >= 0:
            _HOLDERS.discard(self)
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def _remove_leftovers(self) -> list[str]:
        """Delete half-written and half-deleted versions of a previous (crashed) writer."""
        removed = []
        for name in os.listdir(self.root):
            path = self.root / name
            if is_leftover_name(name):
                if is_real_directory(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                removed.append(name)
        if removed:
            fsync_dir(self.root)
        return removed

    def next_version(self) -> int:
        hint = self.latest_hint() or 0
        return max([hint, *self.taken_versions()], default=0) + 1

    def staging_path(self, version: int) -> Path:
        return self.root / f"{version_name(version)}.tmp"

    def publish(self, version: int) -> None:
        """Atomically make a fully synced staging directory a committed version."""
        staging, final = self.staging_path(version), self.path(version)
        if os.path.lexists(final) and not is_real_directory(final):
            # A stray file or link named like the version (its number is taken when this
            # writer opens; a replica's versions are numbered by the primary).
            raise CheckpointError(
                f"cannot publish version {version}: {final} exists and is not a version (a "
                f"stray file or link); move it out of {self.root}"
            )
        fsync_dir(staging)
        os.rename(staging, final)
        fsync_dir(self.root)
        crash_point("published")  # the version is committed from here on
        try:
            write_file_durably(self.root / LATEST, f"{version_name(version)}\n".encode())
        except OSError as exc:
            # LATEST is a hint: the listing (which has the version) decides. A full disk must
            # not make a committed version look failed.
            log.warning(
                "version %d is committed but LATEST could not be updated (%s); "
                "LATEST lags until the next commit",
                version,
                exc,
            )
        crash_point("latest_written")

    def discard(self, version: int) -> None:
        shutil.rmtree(self.staging_path(version), ignore_errors=True)

    def quarantine(self, version: int, reason: str = "") -> None:
        """Move a version that failed verification out of the listing (:func:`set_aside`);
        one that stays listed is remembered in :attr:`damaged`, for retention."""
        if not set_aside(self.root, version, reason):
            self.damaged.add(version)

    def delete(self, version: int) -> None:
        """Delete a committed version so that no crash leaves it half-deleted but listed."""
        trash = self.root / f"{TRASH_PREFIX}{version_name(version)}"
        os.rename(self.path(version), trash)
        fsync_dir(self.root)
        crash_point("trash_renamed")
        shutil.rmtree(trash, ignore_errors=True)
