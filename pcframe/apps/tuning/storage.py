"""Optuna storage from one URL: SQLite (default), PostgreSQL/MySQL, a journal file, or memory.

Studies live in the storage, so a second ``pcframe-tune`` with the same ``study_name`` and
storage resumes where the first stopped, and several workers on several machines can share
one study through PostgreSQL (or a journal file on a shared file system).
"""

from __future__ import annotations

import importlib.util
import os
import time
import warnings
from pathlib import Path

import optuna
from optuna.exceptions import ExperimentalWarning
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend

from pcframe.errors import ConfigError

JOURNAL = "journal://"


def open_storage(url: str | None, heartbeat: int | None = None) -> BaseStorage | None:
    """Storage for ``url``; ``None`` means in memory (nothing survives the process).

    ``sqlite:///file.db``, ``postgresql://user@host:port/db`` (needs ``pcframe[postgres]``),
    ``mysql://...`` and any SQLAlchemy URL go to Optuna's RDB storage; with ``heartbeat``
    seconds, a trial whose worker was killed is marked failed after two missed beats and
    run again by the next worker. ``journal:///path/file.log`` is Optuna's append-only
    journal, safe for several processes on one file system (no heartbeat there).
    """
    if url is None:
        return None
    if url.startswith(JOURNAL):
        path = Path(url.removeprefix(JOURNAL))
        _make_folder(url, path.parent)
        if (os.path.lexists(path) and not path.is_file()) or path.is_symlink():
            # A FIFO blocked the open for ever; a folder or device is no journal either.
            raise ConfigError(
                f"tune.storage={url!r}: {str(path)!r} exists and is not a regular file; give "
                "the path of a journal file (new or one a study wrote)"
            )
        try:
            return JournalStorage(JournalFileBackend(str(path)))
        except OSError as exc:
            raise ConfigError(
                f"tune.storage={url!r}: cannot open the journal {str(path)!r} "
                f"({exc.strerror or exc}); give a path this user can write"
            ) from exc
    if "://" not in url:
        raise ConfigError(
            f"tune.storage={url!r} is not a storage URL; use sqlite:///file.db, "
            "postgresql://user@host/db, journal:///path/file.log or null (in memory)"
        )
    url = _with_installed_driver(url)
    if url.startswith("sqlite://"):
        database = url.removeprefix("sqlite://").removeprefix("/").split("?", 1)[0]
        if database in ("", ":memory:"):  # SQLite's in-memory database: nothing is stored
            raise ConfigError(
                f"tune.storage={url!r} names no database file, so the study would not "
                "outlive the process; give one (sqlite:///study.db) or null (in memory)"
            )
        _make_folder(url, Path(database).expanduser().parent)
    kwargs = {}
    if heartbeat:
        kwargs = dict(heartbeat_interval=heartbeat, grace_period=2 * heartbeat)
    try:
        # Heartbeats and retrying a dead worker's trial are marked experimental in Optuna,
        # but they are its documented way to resume an interrupted study without losing
        # the trial that was running; the warning says nothing the docs do not.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            if heartbeat:
                kwargs["heartbeat_stale_trial_callback"] = (
                    optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)
                )
            return _rdb_storage(url, kwargs)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"tune.storage={url!r} needs the database driver {exc.name!r}; for PostgreSQL "
            "install the extra: pip install 'pcframe[postgres]'"
        ) from exc
    except ImportError as exc:  # Optuna re-raises a missing driver as a bare ImportError
        raise ConfigError(
            f"tune.storage={url!r}: the database driver cannot be imported ({exc}); for "
            "PostgreSQL install the extra: pip install 'pcframe[postgres]'"
        ) from exc


def _make_folder(url: str, folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"tune.storage={url!r}: cannot create the folder {str(folder)!r} "
            f"({exc.strerror or exc}); give a path this user can write"
        ) from exc


def _rdb_storage(url: str, kwargs: dict, attempts: int = 5) -> RDBStorage:
    # Workers started together race to create Optuna's tables in a new database, and the
    # loser's CREATE fails on a duplicate. The tables exist by then: trying again loads them.
    import sqlalchemy.exc  # here: ~0.1 s that pcframe-run (which imports this package) skips

    for attempt in range(attempts):
        try:
            return RDBStorage(url, **kwargs)
        except sqlalchemy.exc.ArgumentError as exc:
            # No such dialect (postgres://, a typo, an upper-case scheme) or no URL at all:
            # SQLAlchemy's NoSuchModuleError / ArgumentError were raw tracebacks.
            raise ConfigError(
                f"tune.storage={url!r} is not a storage URL SQLAlchemy knows ({exc}); use "
                "sqlite:///file.db, postgresql://user@host/db, journal:///path/file.log or "
                "null (in memory)"
            ) from exc
        except sqlalchemy.exc.DBAPIError as exc:
            if attempt == attempts - 1:
                # The driver's own first line says why (no such file, connection refused).
                reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
                raise ConfigError(
                    f"tune.storage={url!r}: cannot open the database ({reason}); check the "
                    "URL, that the server is up and this user may write there"
                ) from exc
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _with_installed_driver(url: str) -> str:
    """``postgresql://`` means psycopg 3 to SQLAlchemy 2.1; use psycopg2 if only it is here."""
    if not url.startswith("postgresql://"):
        return url
    if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2"):
        return "postgresql+psycopg2://" + url.removeprefix("postgresql://")
    return url
