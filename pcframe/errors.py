"""Exceptions that name what went wrong, where, and what to do about it."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every error pcframe raises on purpose."""


class ConfigError(CheckpointError, ValueError):
    """A configuration value is out of range; the message names the key and the fix."""


INTACT = "The last committed checkpoint is intact; training may continue."


class SaveError(CheckpointError):
    """A background stage of one checkpoint version failed.

    Raised in the training thread at the next engine call. The last committed version is
    untouched; training may go on.
    """

    def __init__(self, version: int, step: int, stage: str, cause: BaseException) -> None:
        self.version = version
        self.step = step
        self.stage = stage
        self.cause = cause
        # A cause that is itself a SaveError (a rank's failure inside a round) says it already.
        described = _describe(cause).replace(f" {INTACT}", "")
        end = " " if described.endswith(".") else ". "
        super().__init__(
            f"checkpoint version {version} (step {step}) failed in stage '{stage}': "
            f"{described}{end}{INTACT}"
        )


class TornSnapshot(CheckpointError):
    """Tensors read in place by the background copy changed before it finished: a change
    outside ``optimizer.step()``, the one update that waits for the copy. The version is
    failed rather than committed as a mix of two states."""

    def __init__(self, version: int, names: list[str]) -> None:
        self.names = list(names)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        super().__init__(
            f"{shown} changed in place while version {version} was being copied (outside "
            "optimizer.step(), which alone waits for the copy); call "
            "checkpointer.wait_for_snapshot() before changing them"
        )


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


def _describe(exc: BaseException) -> str:
    import errno

    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return (
            f"no space left on device ({exc.filename or 'checkpoint directory'}): free space, "
            "lower keep_last, or point the checkpointer at a larger disk"
        )
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = exc.filename or "checkpoint directory"
        return (
            f"permission denied or read-only file system ({where}):"
            " make the directory writable for this user or choose another directory"
        )
    return f"{type(exc).__name__}: {exc}"
