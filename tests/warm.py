"""Test children forked from a warm interpreter that has already imported torch.

Most of the default run's time was child processes importing torch (about 2.5 s of CPU
each, several hundred children). A ``WarmProcess`` is still a real process of its own (its
own pid, killed with a real SIGKILL, its own pcframe import, so ``PCFRAME_CRASH_AT`` and
every other variable pcframe reads is read as in a fresh one); it is forked from a
multiprocessing forkserver that imported torch once, instead of starting an interpreter
from nothing.

The child runs ``python -m module args`` as the interpreter would: ``sys.argv``, the
environment, the working directory and ``PYTHONPATH`` first on ``sys.path``; stdout and
stderr into the log file (unbuffered under ``PYTHONUNBUFFERED``); an uncaught exception
through ``sys.excepthook``, a ``SystemExit`` by the interpreter's rules (its message before
the exit hooks), a ``KeyboardInterrupt`` as death by SIGINT; then the interpreter's own
shutdown (non-daemon threads joined, ``atexit`` hooks run, stdio flushed).

What differs from a fresh interpreter, and why the users (the crash harness, the multi-rank
launcher) do not mind: torch and numpy are already imported, with one BLAS/OpenMP thread
(the server starts with ``OMP_NUM_THREADS=MKL_NUM_THREADS=OPENBLAS_NUM_THREADS=1``, as
every child of those launchers asks); ``PYTHONHASHSEED`` is the server's; the parent
process is the forkserver (``os.getppid``, ``multiprocessing.parent_process``), and
``multiprocessing.current_process().name`` is not ``MainProcess``; a few descriptors of
the forkserver stay open. Tests of the interpreter's own start or exit keep using
``subprocess``.

This module stays free of pcframe and torch imports: the forkserver imports it to unpickle
the child's entry point.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

_PRELOAD = ["torch"]
# Sent by a launcher to a child that outlived its deadline: the child writes every thread's
# Python stack into its log (faulthandler), so a hang says where it waits.
STACKS_SIGNAL = signal.SIGUSR1
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
_context = None


def _server():
    """The forkserver, started once, with torch imported under one BLAS/OpenMP thread."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        with mock.patch.dict(os.environ, _ONE_THREAD):  # the server takes this environment
            multiprocessing.forkserver.ensure_running()
        _context = context
    return _context


def _stdio(fd: int, unbuffered: bool, errors: str) -> io.TextIOWrapper:
    """A text stream on ``fd`` as the interpreter makes one: line-buffered, and written
    through to the descriptor at once under ``PYTHONUNBUFFERED``."""
    raw = io.FileIO(fd, "w", closefd=False)
    buffer = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        buffer, encoding="utf-8", errors=errors, line_buffering=True, write_through=unbuffered
    )


def _exit_code(code: object) -> int:
    """The interpreter's rules for ``SystemExit.code``: None is 0, an int itself, anything
    else is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_module(
    module: str, args: list[str], env: dict[str, str], cwd: str, log: str, new_session: bool
) -> None:
    """The child: become ``python -m module args`` and exit as that interpreter would."""
    import atexit
    import faulthandler
    import runpy
    import threading
    import warnings

    if new_session:
        os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = _stdio(1, unbuffered, "strict")
    sys.stderr = _stdio(2, unbuffered, "backslashreplace")
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = list(dict.fromkeys([cwd, *paths, *sys.path]))
    if env.get("PYTHONWARNINGS"):
        sys.warnoptions[:] = env["PYTHONWARNINGS"].split(",")
        warnings._processoptions(sys.warnoptions)  # type: ignore[attr-defined]
    threads = env.get("OMP_NUM_THREADS")
    if threads:  # torch read it when the server imported it; this child's value wins
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [module, *args]
    code = 0
    interrupted = False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:  # what the interpreter does with an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        threading._shutdown()  # type: ignore[attr-defined] - as at interpreter exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    if interrupted:  # the interpreter dies of the SIGINT it did not handle
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


class WarmProcess:
    """The part of ``subprocess.Popen`` the launchers use, for ``python -m module args``."""

    def __init__(
        self,
        module: str,
        args: list[str],
        *,
        env: dict[str, str],
        cwd: Path | str,
        log: Path | str,
        new_session: bool = False,
    ) -> None:
        self._process = _server().Process(
            target=_run_module,
            args=(module, list(args), dict(env), str(cwd), str(log), new_session),
            daemon=False,
        )
        self._process.start()
        self.module = module
        self.pid = self._process.pid
        self.returncode: int | None = None
        # The forkserver reaps the child as soon as it dies, so its pid may be reused at
        # once: signals go through a pidfd, which names this process only.
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._pidfd = os.pidfd_open(self.pid)

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"python -m {self.module}", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
