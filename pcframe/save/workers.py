"""The writer threads (and the opener): a fixed pool of daemon threads taking tasks from one queue.

Not ``concurrent.futures.ThreadPoolExecutor``: at interpreter exit its workers are joined
and its ``submit`` refuses new work ("cannot schedule new futures after interpreter
shutdown") *before* atexit handlers run, so a script that ends with saves in flight would
have its atexit close wait forever for chunks no thread would ever write. These threads keep
working until :meth:`WorkerPool.shutdown`, which the engine's close calls.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from pcframe.runtime.threads import single_threaded_torch

log = logging.getLogger("pcframe")


class WorkerPool:
    def __init__(self, count: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}{i}", daemon=True) for i in range(count)
        ]
        self._started = False
        self._start_lock = threading.Lock()

    def start(self) -> None:
        """Start the threads (once; idempotent). Until then nothing runs: a Checkpointer
        that only restores starts none."""
        with self._start_lock:
            if not self._started:
                for thread in self._threads:
                    thread.start()
                self._started = True

    def submit(self, task: Callable[..., None], *args: Any) -> None:
        """Run ``task(*args)`` on a worker (after :meth:`start`); tasks report their own
        failures."""
        self._queue.put((task, args))

    def shutdown(self) -> None:
        """Finish every queued task, then stop the threads."""
        with self._start_lock:
            if not self._started:
                return
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def _run(self) -> None:
        single_threaded_torch()  # see pcframe.runtime.threads: no second OpenMP team
        while (item := self._queue.get()) is not None:
            task, args = item
            try:
                task(*args)
            except BaseException:  # a task's own bug: keep the worker alive, say so
                log.exception("engine worker task failed")
