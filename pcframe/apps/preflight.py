"""``pcframe-run``'s checkpoint directory, checked before anything trains.

A folder the run cannot use (a file where the folder should be, a parent it cannot write
into, one another running process writes to, checkpoints of another model or of a newer
pcframe) was found by the Checkpointer of the checkpointed run, after the warm-up and the
first baseline run (15 s and more), and ended the run as a failure (exit 1). It is a usage
mistake: :func:`check_run_directory` finds it first and raises a
:class:`~pcframe.errors.ConfigError` (one line naming ``directory=`` and the fix, exit 2).

The writer lock is looked at, never taken (:func:`~pcframe.store.directory.held_lock`): a
probe that took it could make the other writer's open fail. A writer that comes after the
check is still found by the Checkpointer's open, and that is exit 2 too.

The checkpoints a folder holds are checked by loading the newest into a fresh copy of the
workload with :func:`pcframe.load`: it compares the version with the objects exactly as the
run's own restore will (model keys and shapes, optimizer, scheduler, data position) and
writes nothing to the folder. A Checkpointer opened here instead would count a start in the
folder and, closed cleanly, hide an earlier unclean exit from the run's policy.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pcframe.apps.errors import error_text
from pcframe.apps.workloads import Workload
from pcframe.errors import CheckpointError, ConfigError, StateMismatch, UnsupportedCheckpoint
from pcframe.restore.restorer import load
from pcframe.state.rng import capture_rng, restore_rng
from pcframe.store.directory import CheckpointDir, held_lock

FRESH = "give a new directory=... (or none: each run's own output folder)"


def check_run_directory(
    directory: str | os.PathLike[str], workload: Workload, steps: int | None = None
) -> None:
    """Refuse a checkpoint directory the run could not use, before any step is trained.

    ``workload``: a fresh copy of the run's workload (its state is loaded over and dropped).
    ``steps``: the run's steps; a folder that already holds that step or a later one has
    nothing left to train (the rerun reported negative steps per second).

    Raises:
        ConfigError: one line naming ``directory=``, what is wrong and the fix.
    """
    text = str(directory)
    if not text.strip():  # "" is the working directory itself
        raise ConfigError(f"directory={text!r} names no folder; {FRESH}")
    if "://" in text:  # it was made as a local folder named "s3:"
        raise ConfigError(
            f"directory={text!r} is a URL: the run's directory is a local folder; put the "
            "object store in a tier (engine tiers, see docs/tiers.md), or " + FRESH
        )
    path = Path(directory).expanduser()
    _check_writable(path)
    held = held_lock(path)  # another run writing there: found after the warm-up, exit 1
    if held is not None:
        raise ConfigError(f"directory={path} is in use: {held}")
    try:
        versions = CheckpointDir(path).committed_versions() if path.is_dir() else []
    except OSError as exc:
        raise ConfigError(
            f"directory={path}: cannot list it ({exc.strerror or exc}); fix its permissions "
            f"or mount, or {FRESH}"
        ) from None
    if versions:
        step = _check_resumable(path, workload)
        if steps is not None and step is not None and step >= steps:
            raise ConfigError(
                f"directory={path} already holds step {step}, at or past steps={steps}: "
                f"nothing is left to train; give steps= above {step}, or {FRESH}"
            )


def _check_writable(path: Path) -> None:
    """The folder, or the nearest folder above it that exists, takes a new entry."""
    if os.path.lexists(path) and not path.is_dir():
        raise ConfigError(
            f"directory={path} is a file, not a folder: give a folder (it is created if "
            "missing), e.g. directory=ckpts-run"
        )
    existing = path
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"directory={path}: {existing} is a file, so no folder can be made under it; "
            "give a path whose parents are folders"
        )
    try:
        # Tried, not asked: os.access says yes to root on a read-only mount or /sys.
        os.rmdir(tempfile.mkdtemp(prefix=".pcframe-probe-", dir=existing))
    except OSError as exc:
        where = "into it" if existing == path else f"into {existing}, to create it"
        raise ConfigError(
            f"directory={path}: cannot write {where} ({exc.strerror or exc}); give a folder "
            "you can write to, or fix its permissions"
        ) from None


def _check_resumable(path: Path, workload: Workload) -> int | None:
    """The newest valid version loads into the workload, as the run's restore will load it;
    its step."""
    rng = capture_rng()  # load() restores the saved RNG states: this process keeps its own
    try:
        return load(
            path,
            model=workload.model,
            optimizer=workload.optimizer,
            scheduler=workload.scheduler,
            data=workload.loader,
        ).step
    except UnsupportedCheckpoint as exc:
        raise ConfigError(
            f"directory={path} holds checkpoints of a newer pcframe ({error_text(exc)}); "
            f"upgrade pcframe to resume them, or {FRESH}"
        ) from None
    except StateMismatch as exc:
        raise ConfigError(
            f"directory={path} holds checkpoints of another model or setup, which this run "
            f"would resume ({error_text(exc, advice=False)}); {FRESH}, or the workload "
            "settings they were made with"
        ) from None
    except CheckpointError as exc:  # every version damaged, or unreadable storage
        raise ConfigError(
            f"directory={path}: its checkpoints cannot be resumed ({error_text(exc)}); {FRESH}"
        ) from None
    finally:
        restore_rng(rng)
