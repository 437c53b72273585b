"""Apply: a verified state tree loaded into the live training objects."""

from __future__ import annotations

from typing import Any

from pcframe.errors import CheckpointError
from pcframe.objects import TrainingObjects
from pcframe.rng import restore_rng


def apply_tree(objects: TrainingObjects, tree: dict[str, Any], where: str) -> None:
    """Load ``tree`` (a decoded version) into ``objects``; ``where`` names the version.

    Raises:
        CheckpointError: the version lacks state an object needs, or does not fit it.
    """

    def need(key: str) -> Any:
        if key not in tree:
            raise CheckpointError(
                f"{where} has no '{key}' state, but the Checkpointer was given one; "
                f"pass the same objects that were checkpointed"
            )
        return tree[key]

    try:
        if objects.model is not None:
            objects.model.load_state_dict(need("model"))
        if objects.optimizer is not None:
            objects.optimizer.load_state_dict(need("optimizer"))
        if objects.scheduler is not None:
            objects.scheduler.load_state_dict(need("scheduler"))
        if objects.scaler is not None:
            objects.scaler.load_state_dict(need("scaler"))
        for name, obj in objects.stateful.items():
            states = need("stateful")
            if name not in states:
                raise CheckpointError(f"{where} has no stateful object named {name!r}")
            obj.load_state_dict(states[name])
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{where} does not fit the objects given to the Checkpointer: {exc}"
        ) from exc
    restore_rng(tree.get("rng", {}))
    if objects.policy is not None and "policy" in tree:
        objects.policy.load_state_dict(tree["policy"])
    if isinstance(objects.extra, dict) and "extra" in tree:
        objects.extra.clear()
        objects.extra.update(tree["extra"])
