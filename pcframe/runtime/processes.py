"""Child processes that do not outlive the process that started them.

pcframe starts helper processes for a run (the loopback S3 server of ``pcframe-tune``, the
training child of ``pcframe-run``'s supervisor). A parent that exits normally stops them,
but one killed with SIGKILL (the OOM killer, ``kill -9``, a preempted VM's agent) runs no
cleanup: the S3 server kept its port and memory for ever, the training child trained on.
On Linux the kernel can signal a child when its parent dies (``PR_SET_PDEATHSIG``).

The child arms it itself, first thing (:func:`arm_from_environment`), told by
:func:`dying_with_parent`'s environment which process is its parent: arming it between
``fork`` and ``exec`` (``preexec_fn``) runs Python code in a child forked from a process
with threads, which may deadlock. A module pcframe does not own is started through this
file run as a script (:func:`module_command`), which arms, then runs the module: as a
script it imports nothing of pcframe (``python -m`` would import the package: seconds).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
from collections.abc import Mapping

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_ENV = "PCFRAME_DIE_WITH_PARENT"  # the pid of the process whose death ends the child


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists here (another user's counts; a pid too large for
    the system does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    except OverflowError:  # no such pid can exist
        return False
    return True


def dying_with_parent(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child that arms :func:`arm_from_environment`:
    it gets SIGTERM when the thread that starts it ends (with the process, killed or not).

    The signal follows the starting *thread*: start the child from a thread that outlives
    it (the main thread, or the one that waits for it), as every caller in pcframe does.
    """
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def arm_from_environment() -> None:
    """In a child started with :func:`dying_with_parent`'s environment: end with the parent
    (SIGTERM when it dies; exit now if it already has). Nothing elsewhere, or off Linux."""
    parent = os.environ.pop(PARENT_ENV, None)  # not passed on to this process's children
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if str(os.getppid()) != parent:  # it died before the signal was armed
        raise SystemExit(1)


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs ``python -m MODULE ARGS...`` as a child that arms itself first
    (give it :func:`dying_with_parent`'s environment)."""
    return [sys.executable, os.path.abspath(__file__), module, *args]


def _run_module() -> None:
    """``python .../processes.py MODULE ARGS...``: arm, then run MODULE as ``python -m
    MODULE ARGS...`` would."""
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.executable} {__file__} MODULE [ARGS...]")
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this folder's modules (threads, checks...) must not shadow others
    arm_from_environment()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _run_module()
