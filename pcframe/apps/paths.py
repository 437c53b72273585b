"""Where the apps look for the user's own configs (tuned engines, policy YAMLs)."""

from __future__ import annotations

import os
from pathlib import Path


def user_config_dir() -> Path:
    """``$PCFRAME_CONFIG_DIR`` (default ``./pcframe-conf``), absolute."""
    return Path(os.environ.get("PCFRAME_CONFIG_DIR", "pcframe-conf")).expanduser().absolute()
