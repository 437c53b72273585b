"""The fault suite reuses the real S3-compatible server of the tier tests."""

from tests.tiers.conftest import bucket, moto_server  # noqa: F401
