"""Child processes that do not outlive the process that started them.

pcframe starts helper processes for a run (the loopback S3 server of ``pcframe-tune``, the
training child of ``pcframe-run``'s supervisor). A parent that exits normally stops them,
but one killed with SIGKILL (the OOM killer, ``kill -9``, a preempted VM's agent) runs no
cleanup: the S3 server kept its port and memory for ever, the training child trained on.
On Linux the kernel can signal a child when its parent dies (``PR_SET_PDEATHSIG``); it is
armed in the child between ``fork`` and ``exec``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def ends_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets ``sig`` when the
    thread that started it ends (with the process, killed or not); None off Linux.

    The signal follows the starting *thread*: start the child from a thread that outlives
    it (the main thread, or the one that waits for it), as every caller in pcframe does.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: nothing to load after fork
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm
