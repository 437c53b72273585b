"""``SaveProgress``: how far one version got, shared by the pipeline, the gate and its handle.

The pipeline's threads write it (each field under the lock or by one stage only); the
training thread reads it. It holds no tensors, so a handle kept by the user pins no memory.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pcframe.save.status import SaveStatus, Stage

COST_KEY = "save"  # the key of SaveProgress.cost_record in a manifest's engine section


@dataclass(eq=False)
class SaveProgress:
    version: int
    step: int
    nbytes: int
    started: float  # time.perf_counter() at save()
    copy_done: threading.Event = field(default_factory=threading.Event)  # releases the gate
    finished: threading.Event = field(default_factory=threading.Event)
    status: SaveStatus = SaveStatus.IN_FLIGHT
    stage: Stage | None = None  # where it failed
    error: BaseException | None = None
    stall: float = 0.0  # seconds the training thread was blocked by this version
    copy_seconds: float = 0.0
    # CPU seconds the engine's own threads spent on this version (copy, checksum, encode,
    # write, commit), from per-thread CPU clocks: unlike the process's CPU time it does not
    # include training, so it is precise even while training keeps every core busy.
    cpu_seconds: float = 0.0
    durable_at: float = 0.0  # time.perf_counter() at its commit point
    stored_bytes: int = 0
    reported: bool = False  # its error was already raised to the user
    # Failed: whether a committed version stood in the directory then (its SaveError says
    # that one is intact, or that none was lost). Set before ``finished``.
    committed_before: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def failed(self) -> bool:
        return self.error is not None

    def claim_report(self) -> bool:
        """Mark the failure raised; True for the first caller only. The engine's next call
        and a multi-rank round can both find it, and it must reach the user once."""
        with self._lock:
            first, self.reported = not self.reported, True
            return first

    def fail(self, stage: Stage, exc: BaseException) -> None:
        """Record the first failure (later ones are consequences of it)."""
        with self._lock:
            if self.error is None:
                self.error, self.stage = exc, stage

    def cost_record(self) -> dict[str, float | int]:
        """What this save cost so far, as its version's manifest records it (``engine``
        section, key :data:`COST_KEY`): read back by a restore (``Decisions.resumed``)."""
        return {
            "version": self.version,
            "stall": self.stall,
            "durable": time.perf_counter() - self.started,
            "nbytes": self.nbytes,
        }

    def add_cpu(self, since: float) -> None:
        """Charge this thread's CPU time since ``since`` (a ``time.thread_time()``) to it."""
        spent = time.thread_time() - since
        with self._lock:
            self.cpu_seconds += spent
