"""The fault suite reuses the real S3-compatible server of the tier tests."""

from tests.store.tiers.conftest import bucket, moto_server  # noqa: F401
