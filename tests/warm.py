"""Test children forked from a warm interpreter that has already imported torch.

Most of the default run's time was child processes importing torch (about 2.5 s of CPU
each, several hundred children). A ``WarmProcess`` is still a real process of its own (its
own pid, killed with a real SIGKILL, its own pcframe import, so ``PCFRAME_CRASH_AT`` and
every other variable is read as in a fresh one); it is forked from a multiprocessing
forkserver that imported torch once, instead of starting an interpreter from nothing.

The child runs ``python -m module args`` as the interpreter would: ``sys.argv``, the
environment, the working directory and ``sys.path`` as given, stdout and stderr into the
log file, and at the end the interpreter's own shutdown (wait for non-daemon threads, run
the ``atexit`` hooks, flush), so exit codes and what lands in the log are those of
``subprocess.Popen([sys.executable, "-m", module, *args])``.

This module stays free of pcframe and torch imports: the forkserver imports it to unpickle
the child's entry point.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

_PRELOAD = ["torch"]
_context = None


def _server():
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        _context = context
    return _context


def _run_module(
    module: str, args: list[str], env: dict[str, str], cwd: str, log: str, new_session: bool
) -> None:
    """The child: become ``python -m module args`` and exit as that interpreter would."""
    import atexit
    import runpy
    import threading
    import traceback

    if new_session:
        os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [cwd, *paths]
    threads = env.get("OMP_NUM_THREADS")
    if threads:  # torch read it when the server imported it; this child's value wins
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [module, *args]
    code: int | str | None = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        threading._shutdown()  # type: ignore[attr-defined] - as at interpreter exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    os._exit(code or 0)


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

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"python -m {self.module}", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
