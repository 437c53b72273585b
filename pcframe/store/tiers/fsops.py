"""fsspec calls with a hard deadline and cancellation from another thread.

Object-store clients retry internally and can hang on a stalled server for a long time. For
asynchronous file systems (s3fs, gcsfs, ...) we submit the coroutine to fsspec's event loop
ourselves, wrapped in ``asyncio.wait_for``: the call fails with :class:`TimeoutError` at the
deadline, and :meth:`FsCalls.cancel` aborts it from another thread (a newer version, or
shutdown). Synchronous file systems are called directly (no deadline).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from pcframe.errors import TierCancelled


class FsCalls:
    """Runs ``fs.<name>(...)`` with an optional timeout; cancellable ones can be aborted."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self._async = bool(getattr(fs, "async_impl", False))
        self._lock = threading.Lock()
        self._running: set[concurrent.futures.Future[Any]] = set()
        self._cancelled = threading.Event()

    def __call__(
        self, name: str, *args: Any, timeout: float | None = None, cancellable: bool = False, **kw
    ) -> Any:
        if cancellable and self._cancelled.is_set():
            raise TierCancelled(f"{name} cancelled")
        if not self._async:
            return getattr(self.fs, name)(*args, **kw)
        coro = getattr(self.fs, "_" + name)(*args, **kw)
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.fs.loop)
        if cancellable:
            with self._lock:
                self._running.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise TierCancelled(f"{name} cancelled") from None
        except TimeoutError:
            raise TimeoutError(f"{name} did not finish within {timeout:.1f} s") from None
        finally:
            if cancellable:
                with self._lock:
                    self._running.discard(future)

    def begin(self) -> None:
        """Start a new cancellable operation (clears an earlier :meth:`cancel`)."""
        self._cancelled.clear()

    def cancel(self) -> None:
        """Abort every cancellable call in flight and refuse new ones until :meth:`begin`."""
        self._cancelled.set()
        with self._lock:
            running = list(self._running)
        for future in running:
            future.cancel()
