"""Fixtures of the multi-rank tests: the S3 server on loopback (shared with the tier tests)
and the uninterrupted "nodes" run the peer tier's tests compare with."""

from pathlib import Path

import pytest

from tests.distributed.nodes_kit import job
from tests.store.tiers.conftest import bucket, moto_server, own_moto_server  # noqa: F401


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run to step 60, its state saved at every checkpoint step, to
    compare every resumed run with."""
    tmp = tmp_path_factory.mktemp("reference")
    job(tmp, tmp / "ckpt", "reference", 60)
    return tmp
