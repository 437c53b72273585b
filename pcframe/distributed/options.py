"""The values of a multi-rank job's own options, checked before anything is opened.

``DistributedCheckpointer`` checks them when it is made, and so do the integrations'
callbacks when they are made (long before the fit builds the checkpointer): a bad value is
one line naming the option, not a raw error at fit start or a commit protocol that stops
after its first version.
"""

from __future__ import annotations

import math
import os
from typing import Any

from pcframe.distributed.nodes import check_replicas
from pcframe.errors import ConfigError


def check_job_options(
    keep_global: Any,
    protocol_timeout: Any,
    replicas: Any,
    peer_budget: Any = None,
    peer_dir: Any = None,
    node: Any = None,
) -> None:
    """The multi-rank options' values, each refused in one line naming it (a callback checks
    them when it is made: they failed at fit start as raw errors, or ``keep_global=2.5``
    stopped the commit protocol after its first version).

    Raises:
        ConfigError: naming the option and the fix.
    """
    if isinstance(keep_global, bool) or not isinstance(keep_global, int) or keep_global < 2:
        raise ConfigError(
            f"keep_global={keep_global!r}: keep at least 2 global versions (an integer), so "
            "the previous one survives while the next is being published"
        )
    seconds = protocol_timeout
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not (math.isfinite(seconds) and seconds > 0)
    ):
        raise ConfigError(
            f"protocol_timeout={protocol_timeout!r}: give the seconds a rank waits for the "
            "others, a number > 0 (1800 by default)"
        )
    try:
        check_replicas(replicas)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if peer_budget is not None and (
        isinstance(peer_budget, bool) or not isinstance(peer_budget, int) or peer_budget < 0
    ):
        raise ConfigError(
            f"peer_budget={peer_budget!r}: give bytes of peer copies per rank (an integer "
            ">= 0), or None for half the node's free memory"
        )
    if peer_dir is not None and not isinstance(peer_dir, str | os.PathLike):
        raise ConfigError(f"peer_dir={peer_dir!r}: give a folder path, or None")
    if node is not None and not (isinstance(node, str) and node):
        raise ConfigError(f"node={node!r}: give this rank's node name, or None")
