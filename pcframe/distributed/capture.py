"""Split model and optimizer state into the part this rank persists.

Every tensor of ``model.state_dict()`` and ``optimizer.state_dict()`` becomes an item named
by its path (``model/<key>`` or ``optimizer/<param index>/<state key>``). Replicated items are
assigned to one owner rank each (:func:`assign_owners`); sharded items are written by the
rank that holds their box (one rank per box). The owned items go into a JSON-able tree that
the rank's local :class:`~pcframe.Checkpointer` stores like any other state::

    {"kind": "replicated", "data": tensor}
    {"kind": "shard", "data": tensor, "global_shape": [...], "offset": [...]}
    {"kind": "value", "value": <JSON>}          # non-tensor entries, on every rank

The local engine is handed two small views (:class:`ModelView`, :class:`OptimizerView`) in
place of the real model and optimizer: their ``state_dict()`` returns the owned tree, while
``parameters()``, ``state`` and ``register_step_pre_hook`` expose the real tensors, so the
engine keeps reading parameters and optimizer state in place and keeps gating
``optimizer.step()`` on the snapshot copy (no clone in the training thread).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pcframe.distributed.meeting import Call, Doing, Met
from pcframe.distributed.partition import assign_owners
from pcframe.distributed.placement import Placed, is_dtensor, placement_of
from pcframe.errors import CheckpointError


@dataclass
class Item:
    name: str  # "model/<key>" or "optimizer/<index>/<state key>"
    placed: Placed


class StateSplitter:
    """Builds, at every save, the trees of model and optimizer state this rank writes."""

    def __init__(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        rank: int,
        world_size: int,
        meet: Callable[[Doing], Met | None],
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.rank, self.world_size = rank, world_size
        self._meet = meet  # the save's meeting: waited for (a Met) when `changed`, else started
        self._digest: int | None = None
        self.owners: dict[str, int] = {}
        self.written_bytes = 0  # tensor bytes this rank wrote at the last split

    def split(
        self, version: int, step: int
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Placed]]:
        """Return (model tree, optimizer tree) of the state this rank owns at this save, and
        every item of the state as this rank holds it (what a shadow writes from).

        Collective: the ranks meet (:mod:`~pcframe.distributed.meeting`) to check that they
        save the same version and step of state of the same structure.
        """
        items: list[Item] = []
        model_state = self.model.state_dict() if self.model is not None else None
        optim_state = self.optimizer.state_dict() if self.optimizer is not None else None
        if model_state is not None:
            for key, value in model_state.items():
                if isinstance(value, torch.Tensor):
                    items.append(Item(f"model/{key}", placement_of(f"model/{key}", value)))
        if optim_state is not None:
            for index, state in optim_state["state"].items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        name = f"optimizer/{index}/{key}"
                        items.append(Item(name, placement_of(name, value)))
        self._plan(items, version, step)
        placed = {item.name: item.placed for item in items}
        self.written_bytes = sum(_nbytes(p.local) for n, p in placed.items() if self._writes(n, p))
        model_tree = None
        if model_state is not None:
            model_tree = {}
            for key, value in model_state.items():
                entry = self._entry(f"model/{key}", value, placed)
                if entry is not None:
                    model_tree[key] = entry
        optim_tree = None
        if optim_state is not None:
            state_tree: dict[str, Any] = {}
            for index, state in optim_state["state"].items():
                kept = {}
                for key, value in state.items():
                    entry = self._entry(f"optimizer/{index}/{key}", value, placed)
                    if entry is not None:
                        kept[key] = entry
                state_tree[str(index)] = kept
            optim_tree = {"state": state_tree, "param_groups": optim_state["param_groups"]}
        return model_tree, optim_tree, placed

    def _writes(self, name: str, placed: Placed) -> bool:
        if placed.sharded:
            return placed.writer
        return self.owners[name] == self.rank

    def _entry(self, name: str, value: Any, placed: dict[str, Placed]) -> dict[str, Any] | None:
        if not isinstance(value, torch.Tensor):
            return {"kind": "value", "value": value}
        item = placed[name]
        if not self._writes(name, item):
            return None
        if not item.sharded:
            return {"kind": "replicated", "data": item.local}
        assert item.box is not None
        return {
            "kind": "shard",
            "data": item.local,
            "global_shape": list(item.global_shape),
            "offset": list(item.box.offset),
        }

    def _plan(self, items: list[Item], version: int, step: int) -> None:
        """Meet the other ranks; recompute owners when the state's structure changed.

        The digest covers only what is the same on every rank (names, dtypes, global shapes,
        placements), so every rank sees a change at the same save and waits for that meeting;
        a change on some ranks only is refused at it, on every rank.
        """
        description = [
            [
                item.name,
                str(item.placed.local.dtype),
                list(item.placed.global_shape),
                [str(p) for p in item.placed.placements] if item.placed.sharded else None,
            ]
            for item in items
        ]
        digest = int(hashlib.sha256(json.dumps(description).encode()).hexdigest()[:15], 16)
        sharded_bytes = sum(
            _nbytes(i.placed.local) for i in items if i.placed.sharded and i.placed.writer
        )
        doing = Doing(Call.SAVE, version, step, digest, digest != self._digest, sharded_bytes)
        met = self._meet(doing)
        if met is None:  # the structure this rank agreed on last time: the owners hold
            return
        if met.undescribed:  # plan with every rank's state, at the next save
            raise CheckpointError(
                f"version {version} is not saved: save() failed on rank(s) {met.undescribed} "
                "before their state was read (see their error); the next save() plans again"
            )
        replicated = [
            (item.name, _nbytes(item.placed.local)) for item in items if not item.placed.sharded
        ]
        self.owners = assign_owners(replicated, self.world_size, met.sharded_bytes)
        self._digest = digest


class Stash:
    """The owned trees of the save in progress, read by the views during ``local.save()``."""

    model: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None


class ModelView:
    """Stands in for the model inside the rank's local engine (see module docstring)."""

    def __init__(self, model: torch.nn.Module, stash: Stash) -> None:
        self._model, self._stash = model, stash

    def state_dict(self) -> dict[str, Any]:
        assert self._stash.model is not None, "ModelView used outside a distributed save"
        return self._stash.model

    def parameters(self) -> Iterator[torch.Tensor]:
        for param in self._model.parameters():
            yield _local(param)

    def load_state_dict(self, state: Any) -> None:
        _refuse_partial_load()


class OptimizerView:
    """Stands in for the optimizer inside the rank's local engine (see module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, stash: Stash) -> None:
        self._optimizer, self._stash = optimizer, stash

    @property
    def state(self) -> dict[Any, dict[str, Any]]:
        # Local parts of DTensors, so the engine recognises their storage as gated.
        return {
            param: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for param, s in self._optimizer.state.items()
        }

    def state_dict(self) -> dict[str, Any]:
        assert self._stash.optimizer is not None, "OptimizerView used outside a distributed save"
        return self._stash.optimizer

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        return self._optimizer.register_step_pre_hook(lambda _opt, a, k: hook(self, a, k))

    def load_state_dict(self, state: Any) -> None:
        _refuse_partial_load()


def _refuse_partial_load() -> None:
    raise CheckpointError(
        "a rank directory holds only part of the state: restore it with "
        "DistributedCheckpointer.restore(), not with a plain Checkpointer"
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
