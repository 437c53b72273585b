"""A remote version whose data object is gone is a damaged version, not an I/O error.

A version on a remote tier is committed by its ``COMMITTED`` marker, which lists the files.
If one of them is missing afterwards (deleted by hand or by a bucket lifecycle rule), the
version can never be read: like a missing file in a local version (``CorruptCheckpoint``:
"data file is missing") it must be skipped and the next older version restored. Today
``RemoteTier._download`` lets s3fs's ``FileNotFoundError`` through; ``restore/sources.py``
takes it for a transient I/O error, retries, and raises ``RestoreIOError`` ("never go back
silently"), so the job cannot restore at all although an older version is intact.

Found by ``experiments/faults/campaign.py`` (corrupt / remote with the replica's copy deleted).
"""

from __future__ import annotations

import shutil

import torch

import pcframe.policies as P
from pcframe import Checkpointer
from pcframe.store.tiers import RemoteTier, Tiers


def _checkpointer(local, server, bucket, model):
    tier = RemoteTier(f"s3://{bucket}/run", server.storage_options(), timeout=10)
    return Checkpointer(
        local,
        model=model,
        tiers=Tiers({"remote": tier}, backoff=0.05, backoff_max=0.2),
        placement=P.LocalPlusRemote(remote_every=1, local_keep=3, remote_keep=3),
        chunk_bytes=4096,
    )


def test_missing_remote_object_falls_back_to_the_previous_version(moto_server, bucket, tmp_path):
    local = tmp_path / "local"
    model = torch.nn.Linear(8, 8)
    with _checkpointer(local, moto_server, bucket, model) as ckpt:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.fill_(float(step))
            assert ckpt.save(step).wait(30) == "committed"
            assert ckpt.tiers.wait_idle(60)
    assert "run/v00000003/data.bin" in moto_server.keys(bucket)
    shutil.rmtree(local)  # the VM is gone; only the bucket is left
    moto_server.client().delete_object(Bucket=bucket, Key="run/v00000003/data.bin")
    restored = torch.nn.Linear(8, 8)
    with _checkpointer(local, moto_server, bucket, restored) as ckpt:
        assert ckpt.restore() == 2
        assert ckpt.last_restore.skipped and ckpt.last_restore.skipped[0][0] == 3
        assert torch.equal(restored.weight, torch.full_like(restored.weight, 2.0))
