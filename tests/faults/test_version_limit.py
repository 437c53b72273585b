"""Version numbers at the limit: a version reported committed must be listed and restorable.

Numbers above ``MAX_VERSION`` (10**12) are ignored by the listing and by LATEST
(``format/names.py``). A LATEST hint (or a version directory) at ``MAX_VERSION - 1`` is
within the limit, so the writer numbers its next versions ``MAX_VERSION`` and
``MAX_VERSION + 1``: the second one is reported ``committed`` but never listed, so a restart
restores the version before it, and every later save fails ("Directory not empty") because
the writer keeps reusing the invisible number. The writer must instead refuse to number a
version above the limit (a clear error from ``save()``), or not let such a hint push it there.

Found by ``experiments/faults/campaign.py`` (hostile ``latest_near_max``, ``dir_near_max``).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from pcframe import Checkpointer
from pcframe.errors import CheckpointError
from pcframe.format.names import MAX_VERSION, version_name
from pcframe.store.directory import CheckpointDir


def _checkpointer(root, model):
    return Checkpointer(root, model=model, chunk_bytes=4096)


@pytest.mark.parametrize("where", ["latest", "directory"])
def test_versions_reported_committed_stay_listed_at_the_limit(tmp_path, where):
    model = torch.nn.Linear(4, 4)
    with _checkpointer(tmp_path, model) as ckpt:
        ckpt.save(1).wait(30)
    near = MAX_VERSION - 1
    if where == "latest":
        (tmp_path / "LATEST").write_text(f"{version_name(near)}\n")
    else:
        shutil.copytree(tmp_path / version_name(1), tmp_path / version_name(near))
    committed = {}
    with _checkpointer(tmp_path, model) as ckpt:
        ckpt.restore()
        for step in (2, 3, 4):
            try:
                handle = ckpt.save(step)
                status = handle.wait(30)
            except CheckpointError:
                continue  # refusing to go above the limit, clearly, is fine
            if status == "committed":
                committed[handle.version] = step
    listed = CheckpointDir(tmp_path).committed_versions()
    invisible = sorted(set(committed) - set(listed))
    assert not invisible, (
        f"versions {invisible} were reported committed but are not listed (above "
        f"MAX_VERSION={MAX_VERSION}); listed: {listed}"
    )
    with _checkpointer(tmp_path, torch.nn.Linear(4, 4)) as ckpt:
        assert ckpt.restore() == max(committed.values(), default=1)
