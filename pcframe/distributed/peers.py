"""A collective that fails because another rank is gone becomes one clear error.

Gloo reports a rank that exited, was killed or stopped answering as a ``RuntimeError`` with
its transport's wording ("Connection reset by peer ... GLHF!") from deep inside
``torch.distributed``, and a rank that is alive but not in the collective as a timeout. The
training thread's collectives (open, save, restore, close) run under :func:`peers`, which
says what pcframe was doing and what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pcframe.errors import CheckpointError


@contextlib.contextmanager
def peers(what: str) -> Iterator[None]:
    """Turn a failed collective inside the block into a ``CheckpointError`` about ``what``."""
    try:
        yield
    except CheckpointError:
        raise
    except RuntimeError as exc:  # gloo's DistBackendError and its plain RuntimeErrors
        lines = str(exc).strip().splitlines()
        cause = lines[0][:300] if lines else type(exc).__name__
        if "timed out" in str(exc).lower():  # alive, maybe, but not in this collective
            raise CheckpointError(
                f"{what}: no answer from every rank within protocol_timeout ({cause}); a rank "
                "is stuck, or is not making this call: call every DistributedCheckpointer "
                "method on every rank in the same order; the last global version is intact"
            ) from exc
        raise CheckpointError(
            f"{what}: another rank left the job or stopped answering ({cause}); restart "
            "every rank (torchrun does when one exits); the last global version is intact"
        ) from exc
