"""A version this pcframe cannot read but another may stops the restore; nothing is moved.

A newer format version or a codec not registered in this process says nothing against the
version (a newer pcframe wrote it, or a plugin is not imported here). Before, a restore
treated it as corrupt: it renamed the version ``.corrupt-*``, resumed from an older one and
so dropped the newer work without a word beyond a log line.
"""

from __future__ import annotations

import json

import pytest
import torch

from pcframe import Checkpointer, ManifestError, UnsupportedCheckpoint
from pcframe.format.manifest import read_manifest
from tests.format.test_hostile_manifest import rewrite


def two_versions(root, **engine):
    model = torch.nn.Linear(64, 64)
    with Checkpointer(root, model=model, chunk_bytes=4096, **engine) as ckpt:
        ckpt.save(step=1).wait()
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save(step=2).wait()
    return model


def set_header(version_dir, **fields):
    path = version_dir / "manifest.json"
    header, body = path.read_bytes().split(b"\n", 1)
    parsed = json.loads(header) | fields
    path.write_bytes(json.dumps(parsed).encode() + b"\n" + body)


def listing(root):
    return sorted(p.name for p in root.iterdir())


def newer_format(root):
    set_header(root / "v00000002", format_version=99)


def unknown_codec(root):
    def mutate(body):
        for tensor in body["tensors"]:
            if tensor["name"] == "model/weight":
                tensor["codec"] = "zstd_from_a_plugin"

    rewrite(root / "v00000002", mutate)


@pytest.mark.parametrize(
    ("make", "codecs", "message"),
    [
        (newer_format, None, "format_version 99 is not supported"),
        (unknown_codec, {"model/weight": "zstd"}, "unknown codec 'zstd_from_a_plugin'"),
    ],
    ids=["newer format", "unregistered codec"],
)
def test_a_version_of_a_newer_writer_stops_the_restore_and_moves_nothing(
    tmp_path, make, codecs, message
):
    two_versions(tmp_path, codecs=codecs or {})
    make(tmp_path)
    before = listing(tmp_path)
    fresh = torch.nn.Linear(64, 64)
    untouched = fresh.weight.detach().clone()
    with Checkpointer(tmp_path, model=fresh) as ckpt:
        with pytest.raises(UnsupportedCheckpoint) as caught:
            ckpt.restore()
        text = str(caught.value)
        assert text.startswith("checkpoint version 2 cannot be read by this pcframe")
        assert message in text and "nothing was renamed or deleted" in text
        assert "upgrade pcframe" in text and "\n" not in text
        assert torch.equal(fresh.weight, untouched)  # a failed restore changes nothing
        assert ckpt.last_restore.skipped == []
        # Going back is the user's choice, and then it works.
        assert ckpt.restore(version=1) == 1
    assert listing(tmp_path) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".corrupt")]


def test_damage_is_still_corruption_and_falls_back(tmp_path):
    """Only a newer writer stops the restore: a garbled format version is damage."""
    two_versions(tmp_path)
    set_header(tmp_path / "v00000002", format_version="2x")
    with pytest.raises(ManifestError) as caught:
        read_manifest(str(tmp_path / "v00000002" / "manifest.json"))
    assert not isinstance(caught.value, UnsupportedCheckpoint)
    with Checkpointer(tmp_path, model=torch.nn.Linear(64, 64)) as ckpt:
        assert ckpt.restore() == 1
        assert [v for v, _ in ckpt.last_restore.skipped] == [2]
