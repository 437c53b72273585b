"""Which version ``pcframe inspect`` and ``export`` read, and what counts as a checkpoint folder.

Without ``--version`` a command reads the newest version that *reads back* (its manifest,
for ``inspect``; every chunk verified, for ``export``), as a restore does: a newer version
folder that is empty, garbage or damaged is skipped, and one line on stderr names it and
why; one of a newer format stops the command (as it stops a restore: it is not damage, and
an older version is not what the directory holds now). With ``--version N`` that version
is read or the command fails, naming it.

A directory whose writer is still at work changes while it is read: its retention deletes
old versions (and commits new ones) under a ``verify`` or an ``inspect``. A version whose
folder is gone by the time its read failed was deleted, not damaged: it is named as such,
not as a failure, and a walk that runs out of versions lists the directory again.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pcframe.apps.cli_ranks import is_multi_rank_root
from pcframe.distributed.global_versions import RECORDS
from pcframe.errors import CheckpointError, UnsupportedCheckpoint
from pcframe.format.names import VERSION_DIR, version_number
from pcframe.store.directory import (
    CLEAN_EXIT,
    LATEST,
    LOCK,
    QUARANTINE_PREFIX,
    TRASH_PREFIX,
    CheckpointDir,
    is_leftover_name,
    refuse_version_folder,
)
from pcframe.store.starts import STARTS

T = TypeVar("T")
LISTINGS = 3  # walks of a directory whose writer keeps committing and pruning meanwhile

# What a Checkpointer leaves in its folder: a version (``v00000012``), one being written
# (``v00000013.tmp``), deleted (``.trash-v00000009``) or quarantined by a restore
# (``.corrupt-v00000011-<pid>``: a folder of only those is one whose versions all failed),
# LATEST, the lock, the start count.
_MARKERS = {LATEST, LOCK, CLEAN_EXIT, STARTS}
_SET_ASIDE = "|".join(map(re.escape, (TRASH_PREFIX, QUARANTINE_PREFIX)))
_VERSION_LIKE = re.compile(rf"^({_SET_ASIDE})?v\d{{8,}}")


def is_engine_name(name: str) -> bool:
    """Whether a Checkpointer uses ``name`` at the top of its folder (a version's folder or
    one being written, a marker, any dot-file: set-aside versions among them), so nothing
    else may be written there (``v00000001.safetensors`` may: no engine name)."""
    return (
        name in _MARKERS
        or name.startswith(".")
        or bool(VERSION_DIR.match(name))
        or is_leftover_name(name)  # one being written, LATEST.tmp: the next writer removes it
    )


def is_checkpoint_dir(root: Path) -> bool:
    """Whether ``root`` holds anything pcframe writes (a folder it never wrote to does not).

    Raises:
        CheckpointError: ``root`` cannot be listed (permissions, a dead mount).
    """
    try:
        names = [p.name for p in root.iterdir()]
    except OSError as exc:  # unreadable is not "not a checkpoint": it may well be one
        raise CheckpointError(
            f"{root}: cannot list the directory ({exc.strerror or exc}, errno {exc.errno}); "
            "fix its permissions or mount and run again (nothing was read or changed)"
        ) from exc
    return any(name in _MARKERS or _VERSION_LIKE.match(name) for name in names)


def not_a_checkpoint_dir(root: Path) -> CheckpointError:
    return CheckpointError(
        f"{root}: not a pcframe checkpoint directory (no committed checkpoint versions, and "
        "nothing a Checkpointer writes: no vNNNNNNNN folders, LATEST or .writer.lock); give "
        "the directory a Checkpointer saved to"
    )


def _committed(directory: CheckpointDir) -> list[int]:
    """The committed versions, oldest first; none is an error (there is nothing to read)."""
    versions = directory.committed_versions()
    if not versions:
        raise CheckpointError(f"{directory.root}: no committed checkpoint versions")
    return versions


def explicit_version(directory: CheckpointDir, version: int) -> int:
    """``version`` if it is a committed version folder; the same error for every command."""
    versions = _committed(directory)
    if version not in versions:
        raise CheckpointError(f"{directory.root}: version {version} not found; have {versions}")
    return version


def pick(
    directory: CheckpointDir,
    version: int | None,
    read: Callable[[int], T],
    command: str,
    one_line: Callable[[BaseException], str],
) -> tuple[int, T]:
    """``(version, read(version))``: ``version``, or the newest one ``read`` accepts.

    ``read`` raises :class:`CheckpointError` or ``OSError`` for a version it cannot use.
    Skipped newer versions are named on stderr, in one line, before the command's output.
    """
    if version is not None:
        return version, read(explicit_version(directory, version))
    skipped: list[str] = []
    tried: set[int] = set()
    for _ in range(LISTINGS):
        for candidate in reversed(_committed(directory)):
            if candidate in tried:
                continue
            tried.add(candidate)
            try:
                value = read(candidate)
            except UnsupportedCheckpoint as exc:
                older = [v for v in directory.committed_versions() if v < candidate]
                pick = f"--version {older[-1]}" if older else "--version N"
                raise CheckpointError(
                    f"{directory.root}: version {candidate} is of a newer format "
                    f"than this pcframe reads ({one_line(exc)}); not falling back past it: "
                    f"upgrade pcframe, or pick an older version on purpose with {pick}"
                ) from None
            except (CheckpointError, OSError) as exc:
                if not deleted_while_read(directory, candidate):
                    skipped.append(f"version {candidate} ({one_line(exc)})")
                continue
            if skipped:
                print(
                    f"pcframe {command}: warning: using version {candidate}, the newest that "
                    f"reads back; skipped the newer {'; '.join(skipped)}; --version picks one",
                    file=sys.stderr,
                )
            return candidate, value
        if skipped:  # damage, not a writer's retention: listing again finds no other
            break
    reasons = "; ".join(skipped) or "each was deleted while it was read (a live writer)"
    raise CheckpointError(f"{directory.root}: no committed version reads back: {reasons}")


def deleted_while_read(directory: CheckpointDir, version: int) -> bool:
    """Whether ``version``'s folder is gone: a writer's retention deleted it (or set it
    aside) while it was read, so a failed read of it says nothing against the checkpoint."""
    return not directory.path(version).exists()


def check_directory(path: str) -> None:
    """A typo or a version folder given for the checkpoint directory is an error, not 'empty'."""
    if "://" in str(path) and not Path(path).exists():
        raise CheckpointError(
            f"{path} is a URL: this command reads a local checkpoint directory; copy the "
            "prefix to one first, or check the tier with a restore, which verifies every "
            "checksum (Checkpointer(<empty dir>, tiers={'remote': url}).restore())"
        )
    root = Path(path)
    if not root.is_dir():
        what = "not a directory (a file)" if root.exists() else "no such directory"
        inside = next((up for up in root.parents if version_number(up.name) is not None), None)
        hint = f", here {inside.parent}" if inside is not None else ""
        raise CheckpointError(
            f"{root}: {what}; give the checkpoint directory (the one holding the vNNNNNNNN "
            f"version folders{hint})"
        )
    refuse_version_folder(root, "pick the version with --version {}")
    if root.name == RECORDS and is_multi_rank_root(root.parent):
        raise CheckpointError(
            f"{root} is the folder of a multi-rank root's global records; give its parent, "
            f"the root: {root.parent}"
        )
    records = root / RECORDS
    if is_multi_rank_root(root) and records.exists() and not records.is_dir():
        raise CheckpointError(
            f"{records}: not a folder (it holds the root's global records, vNNNNNNNN.json); "
            "move it aside and run again"
        )
    # A folder pcframe never wrote to is a mistake (a wrong path), not an empty listing.
    if not is_multi_rank_root(root) and not is_checkpoint_dir(root):
        raise not_a_checkpoint_dir(root)
