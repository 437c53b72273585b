"""Tier specs: a tier from a path, a URL, a config mapping or a ``Tier`` object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pcframe.errors import TierError
from pcframe.store.tiers.base import Tier, check_tier_name
from pcframe.store.tiers.local import LocalTier

REMOTE_OPTIONS = ("url", "storage_options", "timeout", "min_throughput", "create", "upload_options")

TierSpec = str | os.PathLike[str] | Tier | Mapping[str, Any]


def make_tier(name: str, spec: TierSpec) -> Tier:
    """A tier from a path (local directory), a URL (fsspec remote), a mapping or a Tier.

    Mappings are the config form: ``{"path": "/data/ckpt"}`` or ``{"url": "s3://b/run",
    "storage_options": {...}, "timeout": 30}``.
    """
    check_tier_name(name)
    if isinstance(spec, Tier):
        tier = spec
    elif isinstance(spec, str | os.PathLike):
        text = os.fspath(spec)
        if text.startswith("file://"):
            tier = LocalTier(text[len("file://") :])
        elif "://" in text:
            from pcframe.store.tiers.remote import RemoteTier

            tier = RemoteTier(text)
        else:
            tier = LocalTier(text)
    elif isinstance(spec, Mapping):
        options = dict(spec)
        unknown = [k for k in options if k not in REMOTE_OPTIONS and k != "path"]
        if "url" in options and "path" in options:
            unknown.insert(0, "path")
        if "url" in options and unknown:
            raise TierError(
                f"tiers.{name}.{unknown[0]} is not a remote tier option; it takes "
                f"{', '.join(REMOTE_OPTIONS)}"
            )
        if "url" in options:
            from pcframe.store.tiers.remote import RemoteTier

            tier = RemoteTier(options.pop("url"), **options)
        elif "path" in options and len(options) == 1:
            tier = LocalTier(options["path"])
        else:
            raise TierError(
                f"tiers.{name}: {spec!r} needs a 'path' (local directory) or a 'url' (remote, "
                "with optional storage_options, timeout, min_throughput)"
            )
    else:
        raise TierError(
            f"tiers.{name}: {type(spec).__name__} is not a tier; give a directory path, a URL "
            "such as 's3://bucket/run', a {'url': ...} mapping or a Tier object"
        )
    tier.name = name
    return tier
