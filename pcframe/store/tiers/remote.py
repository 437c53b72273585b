"""A replica tier in an object store (or any fsspec file system), e.g. ``s3://bucket/run``.

Layout under the tier's root URL::

    v00000012/data.bin        uploaded first (every file of the version but the manifest:
                              stripes and codec.bin too)
    v00000012/manifest.json   then the manifest
    v00000012/COMMITTED       last: the commit marker (JSON: version, step, file sizes)

Object stores have no rename, so the marker is the commit point: a listing reports only
prefixes that hold a marker, and a crash, a dead server or a timeout in the middle of an
upload leaves a prefix without one, which no reader ever treats as a version. Deleting goes
the other way round: the marker first, then the rest. Leftover prefixes without a marker are
swept by the (single) writer. Every call has a deadline scaled by its size, and an upload can
be cancelled from another thread, so a stalled server never holds the tier forever.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pcframe.errors import CorruptCheckpoint, TierError
from pcframe.format.manifest import MANIFEST_HEAD, head_crc
from pcframe.format.names import (
    MANIFEST_NAME,
    SAFE_FILE,
    VERSION_DIGITS,
    version_from_digits,
    version_name,
)
from pcframe.runtime.faults import crash_point
from pcframe.store.tiers.base import Tier, number_option, version_files
from pcframe.store.tiers.fsops import FsCalls

_GLOB = ("*", "?", "[")  # what fsspec expands as patterns
MARKER = "COMMITTED"
MARKER_FORMAT = "pcframe-remote-commit"
_ENTRY = re.compile(rf"^{VERSION_DIGITS}/([^/]+)$")  # a file of a version


class RemoteTier(Tier):
    """Versions under an fsspec URL, committed by a marker object uploaded last.

    Args:
        url: e.g. ``s3://bucket/runs/run1`` (needs ``pip install pcframe[s3]``), ``gs://...``.
        storage_options: passed to fsspec (for s3fs: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``, ``config_kwargs``, ...).
        timeout: seconds allowed for one small request (list, marker, delete).
        min_throughput: bytes per second a transfer must at least reach; a file of n bytes
            gets ``timeout + n / min_throughput`` seconds before it is abandoned.
        create: create the bucket / root if it does not exist yet.
        upload_options: extra keyword arguments of the backend's ``put_file`` (s3fs:
            ``chunksize`` of multipart parts, ``max_concurrency``).

    One writer per URL (like one writer per local directory): the sweep of incomplete prefixes
    assumes nobody else is uploading under the same root.
    """

    local = False

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        timeout: float = 30.0,
        min_throughput: float = 4 * 1024 * 1024,
        create: bool = True,
        upload_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise TierError(
                f"remote tier: url={url!r} is not a URL; give one such as 's3://bucket/run'"
            )
        timeout = number_option(timeout, f"remote tier {url}: timeout", low=0, low_ok=False)
        min_throughput = number_option(
            min_throughput, f"remote tier {url}: min_throughput", low=0, low_ok=False
        )
        path = url.split("://", 1)[1].rstrip("/")
        if "//" in path or any(c in path for c in _GLOB):
            # fsspec lists "bkt//run" as nothing (every upload written, none ever listed or
            # restored) and expands *, ? and [ as patterns when it deletes (retention
            # removed another run's objects under "run*").
            raise TierError(
                f"remote tier {url}: an empty path segment ('//') or a glob character "
                f"({' '.join(_GLOB)}) in the URL; write the prefix without them, e.g. "
                "s3://bucket/runs/run1"
            )
        try:
            from fsspec.core import url_to_fs

            # Our own instance: fsspec's shared one may be configured differently elsewhere.
            fs, root = url_to_fs(url, skip_instance_cache=True, **dict(storage_options or {}))
        except (ImportError, ValueError) as exc:
            raise TierError(
                f"remote tier {url}: {exc}. Fix: check the URL's scheme and install its fsspec "
                "backend (s3://: pip install 'pcframe[s3]')"
            ) from exc
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/")
        if not self.root:
            raise TierError(f"remote tier {url}: give a bucket or directory, e.g. s3://bucket/run")
        self.timeout = float(timeout)
        self.min_throughput = float(min_throughput)
        self._calls = FsCalls(fs)
        self._create = create
        self.upload_options = dict(upload_options or {})
        self._ready = False

    @property
    def location(self) -> str:
        return self.url

    def _key(self, version: int, name: str = "") -> str:
        prefix = f"{self.root}/{version_name(version)}"
        return f"{prefix}/{name}" if name else prefix

    def _deadline(self, nbytes: int = 0) -> float:
        return self.timeout + nbytes / self.min_throughput

    def _fail(self, what: str, exc: BaseException) -> TierError:
        return TierError(f"tier {self.name!r} ({self.url}): {what}: {type(exc).__name__}: {exc}")

    # --- listing -------------------------------------------------------------------------

    def _find(self, folder: str) -> list[str]:
        """Every object under ``folder``, from one recursive listing past any cache; ``[]``
        when nothing is there yet (the bucket checked: see :meth:`_check_bucket`)."""
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(folder)
        try:
            return list(self._calls("find", folder, timeout=self._deadline()))
        except FileNotFoundError:
            self._check_bucket()
            return []
        except Exception as exc:
            raise self._fail("cannot list", exc) from exc

    def _scan(self) -> tuple[set[int], set[int]]:
        """(committed versions, versions with objects but no marker) from one recursive list."""
        prefixes: set[int] = set()
        marked: set[int] = set()
        for path in self._find(self.root):
            match = _ENTRY.match(path[len(self.root) :].lstrip("/"))
            if match:
                version = version_from_digits(match.group(1), f"{self.url}: {path}")
                if version is None:
                    continue
                prefixes.add(version)
                if match.group(2) == MARKER:
                    marked.add(version)
        return marked, prefixes - marked

    def _check_bucket(self) -> None:
        """An empty listing is a new run's only if the bucket exists, or will be created: a
        misspelt bucket with ``create=False`` would otherwise read as "no checkpoint yet"
        and training would start from step 0."""
        bucket = self.root.split("/", 1)[0]
        if not bucket:
            return
        if self._create:
            # The bucket is made now rather than at the first upload: an endpoint that is
            # not an object store (another HTTP service answering 404) lists as "nothing"
            # too, and a restore must not take that for "no checkpoint yet".
            self._ensure_root()
            return
        try:
            exists = self._calls("exists", bucket, timeout=self._deadline())
        except Exception as exc:
            raise self._fail("cannot list", exc) from exc
        if not exists:
            raise TierError(
                f"tier {self.name!r} ({self.url}): the bucket {bucket!r} does not exist "
                "(create=False); check its name, or create it (or pass create=True)"
            )

    def committed_versions(self) -> list[int]:
        return sorted(self._scan()[0])

    def find_under_parent(self) -> list[str]:
        """Every object under the folder above this tier's root, from one recursive listing
        (e.g. every rank's tier beside this one: :mod:`pcframe.distributed.remote_shards`);
        ``[]`` when nothing is there yet.

        Raises:
            TierError: the listing failed or timed out, or the bucket does not exist while
                ``create`` is False.
        """
        return self._find(self.root.rsplit("/", 1)[0])

    # --- writing -------------------------------------------------------------------------

    def _ensure_root(self) -> None:
        if self._ready:
            return
        try:
            if self._create:
                self._calls("makedirs", self.root, exist_ok=True, timeout=self._deadline())
            self._ready = True
        except Exception as exc:
            raise self._fail(
                "cannot create the root (missing bucket or no permission?)", exc
            ) from exc

    def write(self, version: int, source: Path, step: int | None = None) -> int:
        self._calls.begin()
        try:
            return self._upload(version, source, step)
        except BaseException:
            self._ready = False  # check the root again next time (a restarted, empty server)
            raise

    def _upload(self, version: int, source: Path, step: int | None) -> int:
        self._ensure_root()
        files = list(version_files(source))
        self._remove_prefix(version)  # objects of an earlier, interrupted attempt
        sizes: dict[str, int] = {}
        for path in files:
            size = path.stat().st_size
            self._calls(
                "put_file",
                str(path),
                self._key(version, path.name),
                timeout=self._deadline(size),
                cancellable=True,
                **self.upload_options,
            )
            sizes[path.name] = size
            crash_point("remote_file_uploaded")
        marker = {
            "format": MARKER_FORMAT,
            "format_version": 1,
            "version": version,
            "step": step,
            "files": sizes,
            "uploaded_at": time.time(),
        }
        # The commit point: only now does a listing report the version.
        self._calls(
            "pipe_file",
            self._key(version, MARKER),
            json.dumps(marker).encode(),
            timeout=self._deadline(),
            cancellable=True,
        )
        return sum(sizes.values())

    def _remove_prefix(self, version: int) -> None:
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(self._key(version))
        try:
            found = self._calls("find", self._key(version), timeout=self._deadline())
        except FileNotFoundError:
            return
        # Keys the backend would take for patterns (another writer's junk) go one by one.
        patterns = [key for key in found if any(c in key for c in _GLOB)]
        plain = [key for key in found if key not in patterns]
        if plain:
            self._calls("rm", plain, timeout=self._deadline())
        for key in patterns:
            self._calls("rm_file", key, timeout=self._deadline())

    def delete(self, version: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._calls("rm_file", self._key(version, MARKER), timeout=self._deadline())
        crash_point("remote_marker_deleted")
        self._remove_prefix(version)

    def sweep(self) -> list[str]:
        """Remove prefixes without a marker (interrupted uploads or deletes) below the newest
        committed version; a newer one is removed just before that version number is reused."""
        committed, incomplete = self._scan()
        newest = max(committed, default=0)
        removed = []
        for version in sorted(incomplete):
            if version < newest:
                self._remove_prefix(version)
                removed.append(version_name(version))
        return removed

    def cancel(self) -> None:
        self._calls.cancel()

    # --- small files beside the versions (a multi-rank job's global records) --------------

    def names(self) -> list[str]:
        """The names of the objects directly under the root (``[]`` when there are none).

        Raises:
            TierError: the listing failed or ran past the tier's deadline.
        """
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(self.root)
        try:
            found = self._calls("ls", self.root, detail=False, timeout=self._deadline())
        except FileNotFoundError:
            return []
        except Exception as exc:  # the backend's own errors too (botocore: a dead endpoint)
            raise self._fail("cannot list", exc) from exc
        return [path.rstrip("/").rsplit("/", 1)[-1] for path in found]

    def put_small(self, name: str, data: bytes) -> None:
        """Write the object ``name`` under the root (whole, in one request).

        Raises:
            TierError: the write failed or ran past the tier's deadline.
        """
        self._ensure_root()
        try:
            self._calls("pipe_file", f"{self.root}/{name}", data, timeout=self._deadline(len(data)))
        except Exception as exc:
            raise self._fail(f"cannot write {name}", exc) from exc

    def read_small(self, name: str, limit: int) -> bytes | None:
        """The object ``name`` under the root; ``None`` if it is gone or larger than
        ``limit`` bytes (its size asked first: a larger one is not downloaded; a ranged
        read was refused on an empty object, S3's 416).

        Raises:
            TierError: the read failed or ran past the tier's deadline.
        """
        key = f"{self.root}/{name}"
        try:
            size = self._calls("size", key, timeout=self._deadline())
            if size is None or size > limit:
                return None
            return self._calls("cat_file", key, timeout=self._deadline(size))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._fail(f"cannot read {key}", exc) from exc

    def remove_small(self, name: str) -> None:
        """Delete the object ``name`` under the root (gone already: nothing to do).

        Raises:
            TierError: the delete failed or ran past the tier's deadline.
        """
        try:
            self._calls("rm_file", f"{self.root}/{name}", timeout=self._deadline())
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._fail(f"cannot delete {name}", exc) from exc

    # --- reading -------------------------------------------------------------------------

    def read_marker(self, version: int) -> dict[str, Any]:
        key = self._key(version, MARKER)
        try:
            raw = self._calls("cat_file", key, timeout=self._deadline())
        except FileNotFoundError:
            raise TierError(
                f"tier {self.name!r}: version {version} is not committed ({key})"
            ) from None
        except OSError as exc:
            raise _naming(exc, key) from exc
        except Exception as exc:  # the backend's own errors (botocore: a dead endpoint)
            raise self._fail(f"cannot read {key}", exc) from exc
        try:
            marker = json.loads(raw)
            files = marker["files"]
            ok = (
                marker.get("format") == MARKER_FORMAT
                and marker.get("version") == version
                and isinstance(files, dict)
                and all(
                    SAFE_FILE.match(n) and isinstance(s, int) and s >= 0 for n, s in files.items()
                )
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            raise CorruptCheckpoint(
                f"{self.url}/{version_name(version)}/{MARKER}: not a valid commit marker; "
                "the version cannot be trusted (delete the prefix or restore an older version)"
            )
        return marker

    def manifest_crc(self, version: int) -> str:
        key = self._key(version, MANIFEST_NAME)
        try:  # the header line only: the rest of the manifest may be megabytes
            head = self._calls(
                "cat_file", key, start=0, end=MANIFEST_HEAD, timeout=self._deadline()
            )
        except FileNotFoundError:
            raise TierError(f"tier {self.name!r}: {key} is missing") from None
        except OSError as exc:
            raise _naming(exc, key) from exc
        except Exception as exc:  # the backend's own errors (botocore: a dead endpoint)
            raise self._fail(f"cannot read {key}", exc) from exc
        return head_crc(head, key)

    @contextlib.contextmanager
    def _download(self, version: int, scratch: Path) -> Iterator[Path]:
        marker = self.read_marker(version)
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        try:
            for name, size in marker["files"].items():
                target = scratch / name
                try:
                    self._calls(
                        "get_file",
                        self._key(version, name),
                        str(target),
                        timeout=self._deadline(size),
                    )
                except FileNotFoundError:  # listed by the marker, gone now: damaged, not I/O
                    raise CorruptCheckpoint(
                        f"{self._key(version, name)}: listed in the commit marker but missing"
                    ) from None
                except OSError as exc:  # name the object; keep the type and errno for retries
                    raise _naming(exc, self._key(version, name)) from exc
                except Exception as exc:  # the backend's own errors (botocore's are not OSError)
                    raise self._fail(f"cannot read {self._key(version, name)}", exc) from exc
                got = os.path.getsize(target)
                if got != size:
                    raise CorruptCheckpoint(
                        f"{self._key(version, name)}: downloaded {got} bytes, the commit marker "
                        f"says {size}"
                    )
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def fetch(self, version: int, scratch: Path) -> contextlib.AbstractContextManager[Path]:
        return self._download(version, scratch)


def _naming(exc: OSError, key: str) -> OSError:
    """``exc`` again (same type and errno), its message prefixed with the object's key."""
    try:
        if exc.errno is None:
            return type(exc)(f"{key}: {exc}")
        return type(exc)(exc.errno, f"{key}: {exc.strerror or exc}")
    except Exception:  # a subclass with another constructor: keep it as it is
        return exc
