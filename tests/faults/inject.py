"""A fault-injecting layer under pcframe's reader and writer: real files, failing calls.

``inject(monkeypatch, "preadv", errno.EIO, nth=1, times=3)`` makes the 1st..3rd calls of
``os.preadv`` made from now on fail with EIO (the same ``OSError`` the kernel would give);
``short_reads(monkeypatch)`` makes every ``os.preadv`` return at most a few bytes, as a slow
network file system may. Everything else (the files, the engine) is real.
"""

from __future__ import annotations

import errno as errno_module
import os
import threading
from collections.abc import Callable
from typing import Any


class Fault:
    """Fail calls ``nth .. nth + times - 1`` of one ``os`` function (1-based)."""

    def __init__(
        self,
        name: str,
        code: int,
        nth: int = 1,
        times: int = 1,
        when: Callable[..., bool] | None = None,
    ) -> None:
        self.name, self.code, self.nth, self.times = name, code, nth, times
        self.when = when
        self.calls = 0
        self.failed = 0
        self._lock = threading.Lock()

    def __call__(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.when is None or self.when(*args, **kwargs):
            with self._lock:
                self.calls += 1
                fail = self.nth <= self.calls < self.nth + self.times
                if fail:
                    self.failed += 1
            if fail:  # as the kernel's error reaches Python: with the file name where known
                path = args[0] if args and isinstance(args[0], str | os.PathLike) else None
                raise OSError(self.code, os.strerror(self.code), *([path] if path else []))
        return original(*args, **kwargs)


def inject(
    monkeypatch: Any,
    name: str,
    code: int,
    nth: int = 1,
    times: int = 1,
    when: Callable[..., bool] | None = None,
) -> Fault:
    fault = Fault(name, code, nth, times, when)
    original = getattr(os, name)
    monkeypatch.setattr(os, name, lambda *a, **k: fault(original, *a, **k))
    return fault


def short_reads(monkeypatch: Any, most: int = 4093) -> None:
    """Every ``os.preadv`` fills at most ``most`` bytes (the reader must loop)."""
    original = os.preadv

    def preadv(fd: int, buffers: list, offset: int, *rest: Any) -> int:
        budget, cut = most, []
        for buffer in buffers:
            view = memoryview(buffer)
            if budget <= 0:
                break
            cut.append(view[: min(len(view), budget)])
            budget -= len(cut[-1])
        return original(fd, cut, offset, *rest)

    monkeypatch.setattr(os, "preadv", preadv)


def opened_in(directory: str) -> Callable[..., bool]:
    """A ``when`` for ``os.open``: only files under ``directory``."""
    directory = str(directory)
    return lambda path, *a, **k: str(path).startswith(directory)


EIO, ENOSPC, EMFILE, ENOMEM, EINTR = (
    errno_module.EIO,
    errno_module.ENOSPC,
    errno_module.EMFILE,
    errno_module.ENOMEM,
    errno_module.EINTR,
)
