"""Apply: a verified state tree loaded into the live training objects.

The one apply of both front doors: :class:`~pcframe.Checkpointer` applies a whole decoded
version, :class:`~pcframe.distributed.DistributedCheckpointer` the tree one rank assembled
from the shards (``partial=True``: only the sections that rank loads).
"""

from __future__ import annotations

from typing import Any

from pcframe.errors import CheckpointError
from pcframe.objects import TrainingObjects
from pcframe.rng import restore_rng


def apply_tree(
    objects: TrainingObjects,
    tree: dict[str, Any],
    where: str,
    *,
    partial: bool = False,
    owner: str | None = "the Checkpointer",
) -> None:
    """Load ``tree`` (a decoded version) into ``objects``; ``where`` names the version.

    Args:
        partial: ``tree`` holds only the sections this caller loads (a multi-rank restore,
            whose caller checked what it needs: a rank beyond the saved world size keeps its
            own per-rank state); a section missing from it is left alone, not refused.
        owner: the front door the objects were given to, named in the errors (``None``:
            not named).

    Raises:
        CheckpointError: the version lacks state an object needs, or does not fit it.
    """

    def has(key: str, obj: Any) -> bool:
        """Whether to load section ``key`` into ``obj`` (refusing a missing one if needed)."""
        if obj is None:
            return False
        if key in tree:
            return True
        if partial:
            return False
        raise CheckpointError(
            f"{where} has no '{key}' state, but {owner} was given one; "
            f"pass the same objects that were checkpointed"
        )

    try:
        if has("model", objects.model):
            objects.model.load_state_dict(tree["model"])
        if has("optimizer", objects.optimizer):
            objects.optimizer.load_state_dict(tree["optimizer"])
        if has("scheduler", objects.scheduler):
            objects.scheduler.load_state_dict(tree["scheduler"])
        if has("scaler", objects.scaler):
            objects.scaler.load_state_dict(tree["scaler"])
        if objects.stateful and has("stateful", objects.stateful):
            states = tree["stateful"]
            for name, obj in objects.stateful.items():
                if name not in states:
                    raise CheckpointError(f"{where} has no stateful object named {name!r}")
                obj.load_state_dict(states[name])
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError) as exc:
        given = f"the objects given to {owner}" if owner else "the objects given"
        raise CheckpointError(f"{where} does not fit {given}: {exc}") from exc
    restore_rng(tree.get("rng", {}))
    if objects.policy is not None and "policy" in tree:
        objects.policy.load_state_dict(tree["policy"])
    if isinstance(objects.extra, dict) and "extra" in tree:
        objects.extra.clear()
        objects.extra.update(tree["extra"])
