"""Every exception pcframe raises on purpose, in one place: each names what went wrong,
where, and what to do about it.

The engine's all derive from :class:`CheckpointError`; the simulator's bad input is a
:class:`SimConfigError` (a ``ValueError``). The policies' and kernels' packages keep their
own (``pcframe.policies.errors``, ``pcframe.kernels.dispatch``), as they stand apart.
"""

from __future__ import annotations

import errno
import pickle
from pathlib import Path
from typing import Any


class CheckpointError(RuntimeError):
    """Base class of every error pcframe raises on purpose."""


class ConfigError(CheckpointError, ValueError):
    """A configuration value is out of range; the message names the key and the fix."""


INTACT = "The last committed checkpoint is intact; training may continue."
# A failed version's last words where no version was committed before it (the first save).
NONE_COMMITTED = (
    "No earlier version was committed in this directory, so none was lost; training may continue."
)


class SaveError(CheckpointError):
    """A background stage of one checkpoint version failed.

    Raised in the training thread at the next engine call. The last committed version, if
    there is one, is untouched; training may go on. ``committed_before``: whether a version
    was committed in the directory when this one failed (the message says it is intact, or
    that none was lost); None: as a SaveError inside ``cause`` says, else True.
    """

    def __init__(
        self,
        version: int,
        step: int,
        stage: str,
        cause: BaseException,
        committed_before: bool | None = None,
    ) -> None:
        self.version = version
        self.step = step
        self.stage = stage
        self.cause = cause
        # A cause that is itself a SaveError (a rank's failure inside a round) says it already.
        described = _describe(cause)
        if committed_before is None:
            committed_before = f" {NONE_COMMITTED}" not in described
        self.committed_before = committed_before
        described = described.replace(f" {INTACT}", "").replace(f" {NONE_COMMITTED}", "")
        end = " " if described.endswith(".") else ". "
        super().__init__(
            f"checkpoint version {version} (step {step}) failed in stage '{stage}': "
            f"{described}{end}{INTACT if committed_before else NONE_COMMITTED}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent whole from a worker process (a process pool, a spawned trial), not as a
        # TypeError about __init__'s arguments; a cause that does not pickle (a library's
        # exception with an __init__ of its own) goes as its type's name and message.
        state = {**self.__dict__, "cause": _picklable(self.cause)}
        return _rebuilt, (type(self), self.args, state)


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # anything a foreign __reduce__ or __init__ raises
        return CheckpointError(f"{type(error).__name__}: {error}")
    return error


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """An exception unpickled without calling its ``__init__`` (whose arguments its
    ``args`` no longer hold)."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class TornSnapshot(CheckpointError):
    """Tensors read in place by the background copy changed before it finished: a change
    outside ``optimizer.step()``, the one update that waits for the copy. The version is
    failed rather than committed as a mix of two states."""

    def __init__(self, version: int, names: list[str]) -> None:
        self.version = version
        self.names = list(names)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        super().__init__(
            f"{shown} changed in place while version {version} was being copied (outside "
            "optimizer.step(), which alone waits for the copy); call "
            "checkpointer.wait_for_snapshot() before changing them"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.version, self.names), self.__dict__


class ManifestError(CheckpointError):
    """A manifest or data file is malformed, hostile or corrupt."""


class CorruptCheckpoint(ManifestError):
    """Checksums or sizes do not match what the manifest promises."""


class UnsupportedCheckpoint(ManifestError):
    """A version this pcframe cannot read but another may: a newer format version, or a
    codec not registered in this process.

    Unlike corruption, it says nothing against the version, so a restore stops here (and
    renames nothing) instead of going back to an older version: that would drop the newer
    work and, once the job saves again, let retention delete it.
    """


class NoValidCheckpoint(CheckpointError):
    """Every committed version failed verification."""


class RestoreIOError(CheckpointError):
    """Reading a committed version failed with an I/O error (not corruption) after retries.

    Nothing was quarantined or deleted: the version is probably fine, the storage is not.
    """


class PolicyError(CheckpointError, TypeError):
    """A policy (a plugin, usually) broke its contract: ``decide`` returned something other
    than a ``Decision``, or ``save_hint`` a hint no caller can follow."""


class DirectoryLocked(CheckpointError):
    """Another live process is already writing checkpoints into this directory."""


class NotRegularFile(CorruptCheckpoint):
    """A checkpoint file is a link, FIFO, device or directory: refused, never read."""


class UnstorableState(CheckpointError, TypeError):
    """A value in the state cannot be stored in a pickle-free checkpoint (the message names
    its path and the fix); a TypeError too, as such a value is."""


class StateMismatch(CheckpointError):
    """The saved state does not fit the objects given; nothing was loaded.

    ``mismatches`` lists every problem found, one line each (also in the message).
    """

    def __init__(self, message: str, mismatches: list[str]) -> None:
        super().__init__(message)
        self.mismatches = list(mismatches)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.mismatches), self.__dict__


class TierError(CheckpointError):
    """A tier is misconfigured or cannot be reached; the message names the tier and the fix."""


class TierCancelled(TierError):
    """A write was cancelled on purpose (superseded by a newer version, or shutting down)."""


class RanksOutOfStep(CheckpointError):
    """The ranks made different calls, or hold state of different structure, at one meeting.

    Final for this job: the checkpointer enters no collective again (restart the job).
    """


class ReshardError(CheckpointError):
    """Sharded state cannot be laid out for this job; the message names both world sizes."""


class SupervisorError(CheckpointError):
    """The child failed on its own (not killed by us) or the run timed out."""


class SimConfigError(ValueError):
    """A simulator parameter or trace that cannot be simulated.

    The message names the offending key (``job.save_stall``) or file and says how to fix it.
    """


def out_of_memory(what: str, nbytes: int | None, path: Path | str) -> OSError:
    """The error for a buffer the machine refused: ENOMEM, an ``OSError`` like any other
    transient failure of a restore (retried, then ``RestoreIOError``; never quarantined).
    Sizes were validated with the manifest, so a refusal says this machine is short of
    memory now (a cgroup, a ulimit, a busy host), not that the checkpoint is bad."""
    size = "" if nbytes is None else f" for {nbytes / 2**20:.1f} MiB"
    return OSError(errno.ENOMEM, f"out of memory{size} ({what})", str(path))


# How the allocators that can fail under a restore word a refusal (torch's CPU allocator
# raises a plain RuntimeError, zstandard a ZstdError): told apart from corrupt bytes.
_REFUSED = ("can't allocate memory", "cannot allocate memory", "out of memory", "not enough memory")


def refused_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation the machine refused (not bad bytes)."""
    return isinstance(exc, MemoryError) or any(w in str(exc).lower() for w in _REFUSED)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return (
            f"no space left on device ({exc.filename or 'checkpoint directory'}): free space, "
            "lower keep_last, or point the checkpointer at a larger disk"
        )
    if isinstance(exc, OSError) and exc.errno in (errno.EFBIG, errno.EDQUOT):
        limit = "the file size limit (ulimit -f)" if exc.errno == errno.EFBIG else "the quota"
        return (
            f"{exc.strerror or 'a write was refused'} ({exc.filename or 'checkpoint directory'})"
            f": the version is larger than {limit} allows; raise the limit, free quota, or "
            "point the checkpointer at another disk"
        )
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = exc.filename or "checkpoint directory"
        return (
            f"permission denied or read-only file system ({where}):"
            " make the directory writable for this user or choose another directory"
        )
    return f"{type(exc).__name__}: {exc}"
