"""Helper processes end with the process that started them, even one killed by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (reaped by nobody yet) has ended: its state in /proc says so.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _killed_parent_leaves(child_code: str) -> int:
    """Run a parent that starts a child as ``child_code`` says, prints the child's pid and
    is then SIGKILLed; the child's pid. The parent is killed only once its child runs."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(child_code)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    return pid


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)  # leave nothing behind either way
            return False
        time.sleep(0.05)
    return True


def test_a_module_run_dying_with_its_parent_dies_with_its_killed_parent():
    """Armed by the child itself (module_command), not between fork and exec, where a
    process with threads may deadlock."""
    pid = _killed_parent_leaves(
        """
        import subprocess, sys, time
        from pcframe.runtime.processes import dying_with_parent, module_command
        child = subprocess.Popen(
            module_command("http.server", "0"),
            env=dying_with_parent(), start_new_session=True, stdout=subprocess.DEVNULL,
        )
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    assert _gone_within(pid, 30.0), "the child outlived its SIGKILLed parent"


def test_the_training_child_arms_itself():
    """pcframe-run's supervisor starts pcframe.apps.training with the parent's pid: its
    main() arms the signal first thing (and takes the variable out of its environment)."""
    code = textwrap.dedent(
        """
        import contextlib, os
        from pcframe.apps import training
        with contextlib.suppress(SystemExit):
            training.main(["--help"])
        print(os.environ.get("PCFRAME_DIE_WITH_PARENT"))
        """
    )
    from pcframe.runtime.processes import dying_with_parent

    done = subprocess.run(
        [sys.executable, "-c", code], env=dying_with_parent(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.stdout.strip().endswith("None"), done.stdout + done.stderr


def test_an_unarmed_child_outlives_its_killed_parent():
    """The control: without the signal, the same child is orphaned and keeps running (what
    a SIGKILLed pcframe-tune did to its S3 server)."""
    pid = _killed_parent_leaves(
        """
        import subprocess, sys, time
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
        )
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    try:
        time.sleep(0.5)
        assert _alive(pid)
    finally:
        os.kill(pid, signal.SIGKILL)


def test_the_loopback_s3_server_of_a_killed_tune_stops():
    pid = _killed_parent_leaves(
        """
        import time
        from pcframe.apps.tuning.loopback_s3 import LoopbackS3
        server = LoopbackS3()
        server.start()
        print(server.proc.pid, flush=True)
        time.sleep(120)
        """
    )
    assert _gone_within(pid, 30.0), "moto.server outlived the SIGKILLed process that ran it"
