"""Does the object store keep a version whole across the ranks? (a finding of the recovery
benchmark, where the driver sometimes waited several checkpoints for one).

    python experiments/recovery/remote_retention_probe.py

Two gloo ranks (torchrun), a ``DistributedCheckpointer`` each with the same S3 tier
(``keep_last=2``, no peers), a save every 0.5 s for 12 versions; rank 1's uploads take 1.6 s
longer than rank 0's (a slower link, a busier host). After every save the script lists the
S3 server: which versions each rank folder holds, which records are there, and which global
versions are whole (every rank's shard) -- what a restore after the loss of every node could
load. Each rank's remote tier prunes by its own ``keep_last``, not by what is whole across
the ranks, so while rank 1 lags by two versions or more, no version is whole in S3 although
rank 1 has uploaded older ones and rank 0 newer ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODE = "PROBE_RANK_MODE"


def rank_main() -> None:
    import torch
    import torch.distributed as dist

    from pcframe.distributed import DistributedCheckpointer
    from pcframe.store.tiers.remote import RemoteTier

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    upload = RemoteTier._upload
    delay = 0.2 if rank == 0 else 1.8

    def slow_upload(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(delay)
        return upload(self, *args, **kwargs)

    RemoteTier._upload = slow_upload
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": os.environ["S3_ENDPOINT"], "region_name": "us-east-1"},
    }
    tiers = {"remote": {"url": os.environ["S3_URL"], "storage_options": options}}
    root = Path(os.environ["ROOT"])
    with DistributedCheckpointer(root, model=model, tiers=tiers, replicas=0, keep_last=2) as ckpt:
        for step in range(1, 13):
            ckpt.save(step).wait()
            dist.barrier()
            if rank == 0:
                print(f"SAVED {step}", flush=True)
            time.sleep(0.5)
    dist.destroy_process_group()


def listing(client, bucket: str) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    found: dict[str, list[int]] = {}
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="job/")
    for page in pages:
        for o in page.get("Contents", []):
            parts = o["Key"].split("/")[1:]
            if parts[0].startswith("rank-") and parts[-1] == "COMMITTED":
                found.setdefault(parts[0], []).append(int(parts[1][1:]))
            elif parts[0] == "global" and parts[-1].endswith(".json"):
                found.setdefault("global", []).append(int(parts[-1][1:-5]))
    return {k: sorted(v) for k, v in sorted(found.items())}


def main() -> None:
    from pcframe.apps.tuning.loopback_s3 import LoopbackS3

    with LoopbackS3(bucket="probe") as s3, tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, S3_ENDPOINT=s3.endpoint, S3_URL=s3.url("job"), ROOT=tmp)
        env.update({MODE: "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"})
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", "2", __file__]
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        client = s3.client()
        never_whole = 0
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith("SAVED"):
                continue
            found = listing(client, "probe")
            ranks = [found.get(f"rank-{r}", []) for r in range(2)]
            whole = [v for v in found.get("global", []) if all(v in held for held in ranks)]
            never_whole += bool(found.get("global")) and not whole
            print(
                f"after save {line.split()[1]:>2}: rank-0 {ranks[0]}, rank-1 {ranks[1]}, "
                f"records {found.get('global', [])}, whole {whole}",
                flush=True,
            )
        proc.wait()
        print(
            f"{never_whole} of 12 listings: global records in S3 but no version whole there "
            f"(torchrun rc {proc.returncode})"
        )


if __name__ == "__main__":
    if os.environ.get(MODE):
        rank_main()
    else:
        main()
