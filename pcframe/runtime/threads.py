"""Threads and the engine: one caller at a time in the front door's methods, and what a
signal handler's engine call does while the thread it interrupted is inside one
(:func:`one_caller_at_a_time`, :func:`engine_call`); and the background threads kept from
slowing training down through OpenMP (:func:`single_threaded_torch`).

**Engine calls on one thread.** Python runs a signal handler on the main thread between
any two bytecodes, so a handler that calls the engine (``ckpt.save(step).wait()``,
``ckpt.close()``) can run in the middle of the engine's own code on that thread: with a
staging slot taken, a version number read but not yet counted, a lock held that the
engine's threads need, or a copy of the snapshot half done that the commit waits for. Run
there, a handler's ``save()`` waited for the slot the interrupted ``save()`` held, its
``close()`` for the version that ``save()`` had not handed over yet (both forever), and two
saves took one version number. So every public call of the engine (:func:`engine_call`)
marks the thread as inside the engine while it runs, and a call on a thread already inside
it (a handler, or a callback of the running call) never runs in the middle of it:

* :attr:`Reentry.DEFERRED` calls (``save``, ``close``, the waits) are recorded and run, in
  the order they were made, as soon as the interrupted call has returned or unwound (a
  ``sys.exit()`` in the handler unwinds it: they run on the way out, then the process
  exits), and at the latest at the thread's next engine call. What they return now says so
  (a save's handle reports ``IN_FLIGHT``); nothing waits inside the handler, so nothing
  can wait for what the interrupted call holds.
* :attr:`Reentry.REFUSED` calls (``decide``, ``maybe_save``, a multi-rank collective) need
  an answer or the other ranks now: they raise :class:`CheckpointError` at once, one line
  naming the fix.
* :attr:`Reentry.ALONE` calls (``restore``) are refused there, and refuse every other call
  while they run (:mod:`pcframe.runtime.interrupts` holds the signals that would land while
  a restore commits until it has returned).

Internal calls (``maybe_save`` saving, ``close`` saving the last step) go through private
methods, so a public call inside a public call is always a handler or a callback. Only the
thread's own calls count: other threads wait for the object's lock as always.

**OpenMP.** Measured on this project's CPU workloads: once any thread other than the
training thread runs a parallel torch op on CPU (a large ``copy_``, ``zero_`` or
``contiguous``), the OpenMP runtime gives that thread a thread team of its own. With more
OpenMP threads than cores, GNU OpenMP stops spinning between parallel regions, so every
parallel op of the training step then waits for sleeping workers to wake up: training steps
ran about 45 % slower for as long as the engine's threads lived, while those threads used
no CPU at all (``experiments/engine/bench_openmp_teams.py``).

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
import math
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from types import FrameType
from typing import Any, TypeVar

import torch

from pcframe.errors import CheckpointError
from pcframe.runtime.checks import real_number
from pcframe.runtime.interrupts import held_to_the_end

log = logging.getLogger("pcframe")

_RUNTIMES = ("libgomp", "libiomp", "libomp")
F = TypeVar("F", bound=Callable[..., Any])


class Reentry(Enum):
    """What an engine call does on a thread that is inside another call of the same engine
    (a signal handler, or a callback, interrupted that call)."""

    DEFERRED = "deferred"  # recorded; runs once the interrupted call has returned
    REFUSED = "refused"  # raises at once, naming the fix
    ALONE = "alone"  # refused there, and refuses every other call while it runs


@dataclass(eq=False)
class DeferredCall:
    """An engine call made while another ran on its thread, run once that one returned."""

    name: str
    run: Callable[[], Any]
    thread: int = field(default_factory=threading.get_ident)
    started: bool = False
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def execute(self) -> None:
        """Run it once. A failure is the call's (kept here, logged): the call that ran it
        goes on; an interrupt (a second signal's ``sys.exit()``, Ctrl-C) goes on up."""
        try:
            self.started = True  # inside the try: an interrupt from here on is recorded
            self.result = self.run()
        except Exception as exc:
            self.error = exc
            log.error("%s() (called while another engine call ran) failed: %s", self.name, exc)
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.done.set()


@dataclass(eq=False)  # compared by identity: two calls of one name are two entries
class _Running:
    name: str
    alone: bool
    # For a call entered and left by two hooks (optimizer.step's pre- and post-hook): the
    # frame it runs in. If that frame has returned the call ended without its second hook
    # (it raised), and the entry is dropped.
    frame: FrameType | None = None

    def ended(self) -> bool:
        return self.frame is not None and not on_stack(self.frame, sys._getframe(1))


def on_stack(frame: FrameType, top: FrameType | None) -> bool:
    """Whether ``frame`` is on the stack whose innermost frame is ``top`` (a frame still
    running there: of this thread, or of another one read with ``current_frames()``)."""
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


class _ThreadCalls:
    """One thread's engine calls in progress (innermost last) and the calls made meanwhile."""

    def __init__(self) -> None:
        self.running: list[_Running] = []
        self.deferred: list[DeferredCall] = []
        self.draining = False  # running the deferred calls now (they may defer more)
        # A refusal raised into the running call, raised again when it ends if code on the
        # way caught it (a handler's exception lands wherever the thread was, and there
        # may be an ``except Exception`` there).
        self.refused: CheckpointError | None = None


class EngineCalls:
    """The calls of one engine (a ``Checkpointer``) in progress, per thread, and the calls
    signal handlers or callbacks made meanwhile (:class:`Reentry`).

    Every step is a single operation on a list (append, remove, index) or a plain store, so
    a handler landing between any two of them finds a consistent state.
    """

    def __init__(self) -> None:
        self._threads = threading.local()

    def _mine(self) -> _ThreadCalls:
        calls = self._threads.__dict__.get("calls")
        if calls is None:  # setdefault: one object even if a handler made one meanwhile
            calls = self._threads.__dict__.setdefault("calls", _ThreadCalls())
        return calls

    def running(self) -> _Running | None:
        """The innermost engine call in progress on this thread, if any."""
        running = self._live(self._mine())
        try:
            return running[-1]
        except IndexError:
            return None

    @staticmethod
    def _live(mine: _ThreadCalls) -> list[_Running]:
        """This thread's calls in progress, less those that ended without saying so."""
        running = mine.running
        while running and running[-1].ended():
            with contextlib.suppress(ValueError):
                running.remove(running[-1])
        return running

    def enter(self, name: str, frame: FrameType) -> _Running:
        """A call that two hooks enter and :meth:`leave`, running in ``frame``."""
        entry = _Running(name, False, frame)
        self._mine().running.append(entry)
        return entry

    def leave(self, entry: _Running) -> None:
        """The end of a call :meth:`enter` began: what was deferred meanwhile runs now."""
        mine = self._mine()
        if self._leave(mine, entry):
            refused, mine.refused = mine.refused, None
            self.drain()
            if refused is not None:
                raise refused

    def defer(self, name: str, run: Callable[[], Any]) -> DeferredCall:
        """Record ``run`` to run once this thread's engine call has returned."""
        call = DeferredCall(name, run)
        self._mine().deferred.append(call)
        log.info(
            "%s() was called while another engine call ran on this thread (a signal handler?): "
            "it runs when that call returns",
            name,
        )
        return call

    def refuse(self, error: CheckpointError) -> CheckpointError:
        """``error``, raised into the running call now, and again as it ends if caught."""
        self._mine().refused = error
        return error

    @contextlib.contextmanager
    def call(self, name: str, *, alone: bool = False) -> Iterator[None]:
        """This thread is inside the engine for the block; the calls deferred meanwhile run
        when the outermost such block ends, on the way out of an exception too."""
        mine = self._mine()
        self.drain()  # left by an earlier call whose end was cut short
        entry = _Running(name, alone)
        try:
            mine.running.append(entry)
            yield
        except BaseException:
            if self._leave(mine, entry):
                mine.refused = None  # raised, or given way to another exception
                self.drain()
            raise
        if self._leave(mine, entry):
            refused, mine.refused = mine.refused, None
            self.drain()
            if refused is not None:  # caught on the way: the caller must still hear it
                raise refused

    def drain_here(self) -> bool:
        """Run the deferred calls now, from inside this thread's engine call, at a point
        where it holds nothing they need: as if it had returned (``close()``, before it
        closes, runs the saves that handlers asked for while it waited). Whether any ran;
        none does while they are being run already (this call is one of them: the rest
        come after it)."""
        mine = self._mine()
        if mine.draining or not any(not call.started for call in mine.deferred):
            return False
        running = list(mine.running)
        try:
            mine.running[:] = []  # one operation: a handler sees the call running or not
            self.drain()
        finally:
            mine.running[:] = running + mine.running
        return True

    @classmethod
    def _leave(cls, mine: _ThreadCalls, entry: _Running) -> bool:
        """Take ``entry`` off; whether it was this thread's outermost engine call."""
        with contextlib.suppress(ValueError):  # not there: an interrupt before the append
            mine.running.remove(entry)
        return not cls._live(mine)

    def drain(self) -> None:
        """Run the deferred calls of this thread, oldest first, unless an engine call of the
        thread is in progress (they wait for its end) or they are being run already."""
        mine = self._mine()
        if mine.draining or not mine.deferred or self._live(mine):
            return
        try:
            mine.draining = True
            while mine.deferred:
                call = mine.deferred[0]
                if not call.started:  # one an interrupt cut short was recorded as failed
                    call.execute()
                with contextlib.suppress(ValueError):
                    mine.deferred.remove(call)
        finally:
            mine.draining = False


def engine_call(
    method: F | None = None,
    *,
    reentry: Reentry = Reentry.REFUSED,
    lock: bool = False,
    name: str | None = None,
    owner: str | None = None,
    later: str | None = None,
    fix: str | None = None,
) -> Any:
    """Make ``method`` an engine call of its object (the module docstring says why).

    Args:
        reentry: what a call on a thread inside another engine call of the object does.
        lock: hold the object's re-entrant lock for the call (:func:`one_caller_at_a_time`).
        name: how the call is named in messages (default: the method's name).
        owner: the caller's prefix in messages (default: the object's class name; ``""``
            for none, e.g. ``optimizer.step``).
        later: for :attr:`Reentry.DEFERRED`, the name of a method of the object that records
            the call and returns what the caller gets now (default: record the call itself,
            return None).
        fix: for :attr:`Reentry.REFUSED`, the end of the refusal's line; ``{running}`` is
            replaced by the interrupted call's name.

    The object's calls are tracked by its ``_engine_calls`` (an :class:`EngineCalls`,
    made on first use; a handle sets it to its engine's).
    """

    def wrap(method: F) -> F:
        label = name or method.__name__

        @functools.wraps(method)
        def engine_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            state = self.__dict__
            calls = state.get("_engine_calls") or state.setdefault("_engine_calls", EngineCalls())
            running = calls.running()
            if running is not None:  # a handler or a callback interrupted this thread's call
                if running.alone or reentry is not Reentry.DEFERRED:
                    prefix = type(self).__name__ if owner is None else owner
                    caller = f"{prefix}.{label}" if prefix else label
                    raise calls.refuse(CheckpointError(_refusal(caller, running, fix)))
                if later is not None:
                    return getattr(self, later)(*args, **kwargs)
                calls.defer(label, functools.partial(engine_method, self, *args, **kwargs))
                return None
            guard = state.setdefault("_one_caller", threading.RLock()) if lock else None
            with guard or contextlib.nullcontext():
                alone = reentry is Reentry.ALONE
                # A restore holds the signals that land while it commits until it has ended
                # (pcframe.runtime.interrupts): their handlers find it over, not running.
                held = held_to_the_end() if alone else contextlib.nullcontext()
                with held, calls.call(label, alone=alone):
                    return method(self, *args, **kwargs)

        return engine_method  # type: ignore[return-value]

    return wrap(method) if method is not None else wrap


class Bell:
    """A wake-up that other threads ring and one thread (the training thread) waits on.

    It is a plain lock that only the waiter acquires and the ringers only release, so a
    signal handler's exception (``sys.exit()``, Ctrl-C) raised on the waiter wherever it
    is can leave nothing taken that a ringer needs: waiting on an ``Event`` or a
    ``Condition`` takes the lock their setters take, and an exception between two of
    their Python-level bytecodes left it taken (the engine's threads then stopped for
    good). A ring may be stale (rung before the waiter looked): waiters check again.
    """

    def __init__(self) -> None:
        self._rung = threading.Lock()
        self._rung.acquire()  # held: not rung

    def ring(self) -> None:
        with contextlib.suppress(RuntimeError):  # rung already
            self._rung.release()

    def wait(self, timeout: float) -> None:
        """Until rung (or ``timeout`` seconds); the waiter checks what it waits for."""
        self._rung.acquire(timeout=max(0.0, timeout))


def one_caller_at_a_time(
    method: F | None = None,
    *,
    alone: bool = False,
    reentry: Reentry = Reentry.REFUSED,
    fix: str | None = None,
    later: str | None = None,
) -> Any:
    """Run ``method`` under its object's own re-entrant lock, as an :func:`engine_call`.

    A ``Checkpointer`` used from two threads (the loop and a notice handler's thread) must
    number versions in the order it hands them to the pipeline: two saves at once took the
    same number, and one of them was discarded or failed on the other's folder. Other
    threads wait for the lock; the thread that holds it is inside the engine, and a call it
    makes meanwhile (a signal handler, a callback) follows ``reentry``. ``alone=True``
    (``restore``) is :attr:`Reentry.ALONE`: a save there mixed old and restored tensors
    into a valid-looking version, or waited forever for the staging buffers the restore
    holds, and a restore inside a save's capture wrote the tensors being captured.
    """
    mode = Reentry.ALONE if alone else reentry
    return engine_call(method, reentry=mode, lock=True, later=later, fix=fix)


def _refusal(caller: str, running: _Running, fix: str | None) -> str:
    if running.alone or fix is None:
        tail = (
            f"call it once {running.name}() has returned (a notice source records a notice "
            "for the next maybe_save instead)"
        )
    else:
        tail = fix.format(running=running.name)
    return (
        f"{caller}() was called while {running.name}() runs on this thread (from a signal "
        f"handler?); {tail}"
    )


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


def check_timeout(timeout: object, call: str) -> None:
    """Refuse a ``timeout=`` that is not ``None`` or a number of seconds, naming the call (a string
    reached the wait as a raw TypeError from a comparison inside threading)."""
    if timeout is None:
        return
    if not real_number(timeout):
        raise TypeError(
            f"{call}(timeout={timeout!r}): give seconds (an int or float) or None to wait "
            "as long as it takes"
        )
    if math.isnan(float(timeout)):  # a negative one is a deadline already passed: as 0
        raise ValueError(f"{call}(timeout=nan): give seconds, or None")
