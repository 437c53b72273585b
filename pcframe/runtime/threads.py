"""Threads and the engine: one caller at a time in the front door's methods
(:func:`one_caller_at_a_time`), and the background threads kept from slowing training down
through OpenMP (the rest of this docstring).

Measured on this project's CPU workloads: once any thread other than the training thread
runs a parallel torch op on CPU (a large ``copy_``, ``zero_`` or ``contiguous``), the OpenMP
runtime gives that thread a thread team of its own. With more OpenMP threads than cores,
GNU OpenMP stops spinning between parallel regions, so every parallel op of the training
step then waits for sleeping workers to wake up: training steps ran about 45 % slower for
as long as the engine's threads lived, while those threads used no CPU at all
(``experiments/engine/bench_openmp_teams.py``).

``torch.set_num_threads`` cannot be used here: it is process-wide and would also change
the training thread. OpenMP's own ``omp_set_num_threads`` acts on the calling thread only,
so each engine thread calls it (through the OpenMP runtime torch already loaded) once it
starts: its torch ops then run on the thread itself and no second team is ever made.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from pcframe.errors import CheckpointError
from pcframe.runtime.interrupts import held_to_the_end

log = logging.getLogger("pcframe")

_RUNTIMES = ("libgomp", "libiomp", "libomp")
F = TypeVar("F", bound=Callable[..., Any])


def one_caller_at_a_time(method: F | None = None, *, alone: bool = False) -> Any:
    """Run ``method`` under its object's own re-entrant lock.

    A ``Checkpointer`` used from two threads (the loop and a notice handler's thread) must
    number versions in the order it hands them to the pipeline: two saves at once took the
    same number, and one of them was discarded or failed on the other's folder.

    The lock is re-entrant (``maybe_save`` calls ``save``). ``alone=True`` (``restore``)
    refuses re-entry both ways: while it runs, a call of another serialized method from the
    same thread (a signal handler, or a callback of the restore: a stateful object's
    ``load_state_dict``, the policy's ``observe``) raises ``CheckpointError`` instead of
    running in the middle of it (a save there mixed old and restored tensors into a
    valid-looking version, or waited forever for the staging buffers the restore holds),
    and so does the method itself called from inside another serialized one (a restore in
    the middle of a save's capture). Other threads wait for the lock as always. Signals
    held while the restore commits are handled when it returns (:mod:`pcframe.runtime.interrupts`),
    so a held handler that saves finds it over.
    """

    def wrap(method: F) -> F:
        name = method.__name__

        @functools.wraps(method)
        def serialized(self: Any, *args: Any, **kwargs: Any) -> Any:
            state = self.__dict__
            lock = state.setdefault("_one_caller", threading.RLock())  # atomic in CPython
            with lock:
                # This thread's serialized calls in progress (only the lock holder has any).
                running: list[tuple[str, bool]] = state.setdefault("_one_caller_running", [])
                refusing = next((n for n, a in running if a), None) or (
                    running[-1][0] if alone and running else None
                )
                if refusing is not None:
                    raise CheckpointError(
                        f"{type(self).__name__}.{name}() was called while {refusing}() runs "
                        f"on this thread (from a signal handler?); call it once {refusing}() "
                        "has returned (a notice source records a notice for the next "
                        "maybe_save instead)"
                    )
                entry = (name, alone)
                with held_to_the_end() if alone else contextlib.nullcontext():
                    try:  # an interrupt before the append leaves nothing to take off
                        running.append(entry)
                        return method(self, *args, **kwargs)
                    finally:
                        if running and running[-1] is entry:
                            running.pop()

        return serialized  # type: ignore[return-value]

    return wrap(method) if method is not None else wrap


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP library mapped into this process (torch's), or None if none is found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line}
    except OSError:  # not Linux: leave OpenMP alone
        return None
    for path in sorted(paths):
        if path.rsplit("/", 1)[-1].startswith(_RUNTIMES):
            try:
                # The same file is already loaded: dlopen returns that instance.
                return ctypes.CDLL(path)
            except OSError as exc:
                log.debug("cannot open the OpenMP runtime %s: %s", path, exc)
    return None


def single_threaded_torch() -> None:
    """Make torch's CPU ops called from the current (engine) thread run on it alone.

    Call it first thing in every long-lived background thread that may run torch CPU ops.
    Never call it from the training thread.
    """
    # torch sets each thread's OpenMP thread count lazily, on that thread's first parallel
    # op; run that now, or it would overwrite the setting below later.
    torch.get_num_threads()
    runtime = _openmp_runtime()
    if runtime is not None:
        runtime.omp_set_num_threads(1)


@contextlib.contextmanager
def one_openmp_thread() -> Iterator[None]:
    """Run the torch CPU ops of this block on the calling thread alone, then restore.

    For the training thread while it helps an engine thread copy: its own OpenMP team would
    oversubscribe the cores. Only this thread's OpenMP setting changes.
    """
    runtime = _openmp_runtime()
    if runtime is None:
        yield
        return
    before = torch.get_num_threads()
    runtime.omp_set_num_threads(1)
    try:
        yield
    finally:
        runtime.omp_set_num_threads(before)
