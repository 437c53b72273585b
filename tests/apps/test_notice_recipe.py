"""docs/integrations.md's "Saving on a preemption notice", run as written, given a real SIGTERM.

The recipe is why pcframe exists (a spot VM taken back after a notice), so its snippet must
work verbatim: the signal must not kill the process (SIGTERM's default action), the step in
progress must be saved and durable before the script leaves, and it must leave cleanly.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pcframe.format.manifest import MANIFEST_NAME, read_manifest
from pcframe.store.directory import CheckpointDir

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
FOLDER = "ckpts-notice"  # the snippet's checkpoint folder


def recipe(directory: Path) -> Path:
    text = DOC.read_text()
    section = text[text.index("## Saving on a preemption notice") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/integrations.md lost the notice recipe's snippet"
    script = directory / "train.py"
    script.write_text(match.group(1))
    return script


@pytest.mark.slow
def test_the_notice_recipe_saves_the_step_in_progress_on_a_real_sigterm(
    tmp_path, python, child_env
):
    proc = subprocess.Popen(
        [python, str(recipe(tmp_path))],
        cwd=tmp_path,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    directory = CheckpointDir(tmp_path / FOLDER)
    try:
        # A periodic version first: the Checkpointer (and its signal handler) is in place
        # and training runs. Deadlines here only bound a hung child, they time nothing.
        deadline = time.monotonic() + 240
        while not (directory.root.is_dir() and directory.committed_versions()):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no periodic checkpoint committed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]  # not -SIGTERM: the notice was recorded instead
    match = re.search(r"preemption notice: step (\d+) is durable, leaving", out)
    assert match, out[-2000:] + err[-2000:]
    newest = directory.committed_versions()[-1]
    manifest = read_manifest(str(directory.path(newest) / MANIFEST_NAME))
    assert manifest.step == int(match.group(1))  # the step in progress, not the last periodic
