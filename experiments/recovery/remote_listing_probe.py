"""What listing the object store costs a multi-rank restore, per rank folder (a finding of the
recovery benchmark: its "records / listing" phase, about 1 s with 4 ranks even when every
shard comes from the peers).

    python experiments/recovery/remote_listing_probe.py [RANKS]

Rank 0's restore lists ``RemoteShards.ranks()``, then ``versions(r)`` for every rank, each
through its own ``RemoteTier`` (an S3FileSystem made with ``skip_instance_cache=True``), so
each rank folder pays a new client's first request; one recursive listing of the whole prefix
on one client answers the same question once. Then ``records()``: every record ever published
stays in ``<url>/global/`` and each is downloaded, one request after another, at every restore.
"""

from __future__ import annotations

import sys
import time

from fsspec.core import url_to_fs

from pcframe.apps.tuning.loopback_s3 import LoopbackS3
from pcframe.distributed.remote_shards import RemoteShards


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    with LoopbackS3(bucket="probe") as s3:
        client = s3.client()
        for r in range(ranks):
            for v in (1, 2):
                prefix = f"job/rank-{r}/v{v:08d}"
                client.put_object(Bucket="probe", Key=f"{prefix}/data.bin", Body=b"x" * 1000)
                client.put_object(Bucket="probe", Key=f"{prefix}/COMMITTED", Body=b"{}")
        shards = RemoteShards(s3.url("job"), {"storage_options": s3.storage_options()})
        start = time.perf_counter()
        found = {r: shards.versions(r) for r in shards.ranks()}
        per_rank = time.perf_counter() - start
        start = time.perf_counter()
        fs, root = url_to_fs(s3.url("job"), skip_instance_cache=True, **s3.storage_options())
        keys = fs.find(root)  # a new client, as the restore's would be
        once = time.perf_counter() - start
        print(
            f"{ranks} rank folders: ranks() + versions() per rank {per_rank:.3f} s ({found[0]}..)"
        )
        print(f"one recursive find of the prefix on a new client: {once:.3f} s, {len(keys)} keys")
        # The records in <url>/global/ are never deleted (one per published version), and
        # records() reads every one of them at every restore.
        for count in (10, 200):
            for v in range(1, count + 1):
                client.put_object(Bucket="probe", Key=f"job/global/v{v:08d}.json", Body=b"{}")
            start = time.perf_counter()
            got = shards.records()
            print(f"records() with {len(got)} records in S3: {time.perf_counter() - start:.3f} s")


if __name__ == "__main__":
    main()
