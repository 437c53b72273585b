"""A remote tier listing a version number above the limit must not poison numbering."""

from __future__ import annotations

import torch

import pcframe.policies as P
from pcframe import Checkpointer
from pcframe.store.tiers import RemoteTier, Tiers


def tiers(server, bucket) -> Tiers:
    tier = RemoteTier(f"s3://{bucket}/run", server.storage_options(), timeout=10)
    return Tiers({"remote": tier}, backoff=0.05, backoff_max=0.2)


def test_huge_remote_commit_marker_is_ignored(moto_server, bucket, tmp_path, caplog):
    placement = P.LocalPlusRemote(remote_every=1, local_keep=2, remote_keep=2)
    model = torch.nn.Linear(3, 3)
    with Checkpointer(
        tmp_path / "a", model=model, tiers=tiers(moto_server, bucket), placement=placement
    ) as ckpt:
        ckpt.save(1).wait()
        assert ckpt.tiers.wait_idle(60)
    s3 = moto_server.client()
    s3.put_object(Bucket=bucket, Key="run/v99999999999999999999/COMMITTED", Body=b"{}")
    with Checkpointer(
        tmp_path / "b",
        model=model,
        tiers=tiers(moto_server, bucket),
        placement=placement,
        take_over=True,  # a new folder saving beside the remote's version 1, not restoring it
    ) as ckpt:
        handle = ckpt.save(2)
        assert handle.version == 2, handle
        assert handle.wait() == "committed"
        assert ckpt.restore() == 2
    assert "above the limit" in caplog.text
