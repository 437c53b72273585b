"""Rebuild this rank's state from one global version, whatever the world size that wrote it.

:func:`prepare` takes the :class:`~pcframe.distributed.index.SavedIndex` of a version and
works out what this rank needs: the whole tensor for replicated state, its own box for
sharded state (as placed *now*, so a changed world size reshards). It reads only those
pieces (chunk checksums verified) and assembles them. Nothing is applied
until every rank has prepared successfully; :meth:`Prepared.apply` then loads the state.

Per-rank state (RNG, data position and other ``stateful`` objects) comes from the same rank
of the saved job; when the world size changed, ranks beyond the old world size keep theirs.
Small replicated state (scheduler, scaler, extra, optimizer param groups) comes from the same
rank when it exists, else from saved rank 0.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from pcframe.distributed.index import SavedIndex, SavedItem, ShardSource
from pcframe.distributed.placement import (
    Box,
    Placed,
    cover_problem,
    is_dtensor,
    placement_of,
    rebuild,
)
from pcframe.errors import CheckpointError, ManifestError, ReshardError, StateMismatch
from pcframe.format.manifest import MANIFEST_NAME, Manifest
from pcframe.format.tree import DTYPES, decode_tree
from pcframe.restore.reader import InPlaceRead, read_entries, read_entries_into
from pcframe.state.apply import apply_tree
from pcframe.state.check import LoadPlan, LoadRules, describe_problems, plan_load
from pcframe.state.in_place import in_place_targets
from pcframe.state.objects import PER_RANK, Section, TrainingObjects

_HINT = "Pass the same objects that were checkpointed"
# DistributedCheckpointer.restore casts nothing (no allow_cast: a shard's bytes are read into
# the live tensors as they are), so the engine's "restore(allow_cast=True)" is no advice here.
_CAST_HINT = "; build them in the dtypes they were saved in and cast them after restore()"
_RULES = LoadRules(partial=True, owner=None, hint=_HINT)


@dataclass
class Prepared:
    """Everything this rank will load, already read and verified; applied only on success."""

    model_state: dict[str, Any] | None = None
    optimizer_state: dict[str, Any] | None = None
    sections: dict[str, Any] = field(default_factory=dict)
    per_rank_from: int | None = None
    resharded: bool = False
    # Live tensors verified but not yet read into (one per saved rank read from): the
    # apply's last fallible step fills them (pcframe.state.apply, ``fill``).
    fills: list[InPlaceRead] = field(default_factory=list)
    in_place_bytes: int = 0  # after apply: the bytes read straight into live tensors
    plan: LoadPlan | None = None  # what check() found: the apply's plan

    def tree(self) -> dict[str, Any]:
        """What :func:`~pcframe.state.apply.apply_tree` loads: only what this rank read."""
        tree = {
            name: value
            for name, value in self.sections.items()
            # learned policy state and extras are loaded only as the dicts they were saved as
            if name not in (Section.POLICY, Section.EXTRA) or isinstance(value, dict)
        }
        if self.model_state is not None:
            tree[Section.MODEL] = self.model_state
        if self.optimizer_state is not None:
            tree[Section.OPTIMIZER] = self.optimizer_state
        return tree

    def check(self, objects: TrainingObjects, version: int) -> None:
        """Raise what the apply would refuse (the state does not fit ``objects``), before
        the ranks exchange their verdicts: a mismatch on one rank then stops every rank
        with nothing applied (found at the apply, it left the others loaded and training)."""
        # Kept for the apply, which would make it again (3200 tensors: 56 ms).
        plan = self.plan = plan_load(objects, self.tree(), _RULES)
        if plan.problems:
            where = f"global version {version}"
            advice = _HINT + (_CAST_HINT if plan.casts else "")
            raise StateMismatch(
                describe_problems(where, "the objects given", plan.problems, advice),
                plan.problems,
            )

    def apply(self, objects: TrainingObjects) -> None:
        """Load the prepared state into ``objects`` (every rank prepared successfully)."""
        fill = _Fills(self.fills) if self.fills else None
        try:
            apply_tree(objects, self.tree(), "the global version", _RULES, fill, self.plan)
        finally:
            self.release()
        self.in_place_bytes = fill.filled if fill is not None else 0

    def release(self) -> None:
        """Let go of the files kept for the fill (the version is applied, or not taken)."""
        for fill in self.fills:
            fill.release()


@dataclass
class _Fills:
    """The fills of every saved rank read from, as one ``InPlaceFill`` (pcframe.state.apply)."""

    reads: list[InPlaceRead]
    filled: int = 0  # the bytes the last fill read into live tensors

    def fill(self, sections: Collection[str]) -> int:
        self.filled = sum(read.fill(sections) for read in self.reads)
        return self.filled

    def unfill(self) -> bool:
        return all([read.unfill() for read in self.reads])  # every one, even after a False


def prepare(
    index: SavedIndex,
    objects: TrainingObjects,
    rank: int,
    world_size: int,
    reshard: bool = True,
    threads: int = 4,
) -> Prepared:
    """Read and assemble what this rank needs from ``index``; nothing is applied yet.

    Raises:
        ReshardError: sharded state that cannot be laid out for this world size.
        CheckpointError: the saved state does not fit the objects (keys, shapes, groups).
        ManifestError / CorruptCheckpoint / OSError: a shard is damaged or missing.
    """
    version, old_world = index.record.version, index.world_size
    if not reshard and old_world != world_size:
        sharded = sorted(n for n, i in index.items.items() if i.sharded)
        if sharded:
            raise ReshardError(
                f"global version {version} was saved by {old_world} ranks with sharded state "
                f"({sharded[0]}, ...) and this job has {world_size} ranks; pass reshard=True "
                f"or restore with {old_world} ranks"
            )
    own = rank if rank < old_world else None
    small_from = own if own is not None else 0
    targets: dict[str, tuple[Placed, Box]] = {}
    current_model = objects.model.state_dict() if objects.model is not None else None
    if current_model is not None:
        saved_keys = {n[len("model/") :] for n in index.items if n.startswith("model/")}
        saved_keys |= {n[len("model/") :] for n in index.value_names if n.startswith("model/")}
        _same_keys(set(current_model), saved_keys, version, Section.MODEL)
        for key, value in current_model.items():
            name = f"model/{key}"
            if isinstance(value, torch.Tensor):
                placed = placement_of(name, value)
                targets[name] = (placed, placed.target_box)
    optimizer_plan = _optimizer_targets(index, objects.optimizer, targets, version)

    needed: dict[int, set[int]] = defaultdict(set)
    pieces = {
        name: _pieces(name, placed, box, index, rank, world_size)
        for name, (placed, box) in targets.items()
    }
    for found in pieces.values():
        for source, _ in found:
            needed[source.rank].add(source.entry)
    resharded = old_world != world_size and any(index.items[n].sharded for n in pieces)
    wanted = _small_state(index, own, small_from)
    for _, source_rank, node in wanted:
        needed[source_rank].update(_tensor_refs(node, index, source_rank))
    # Non-tensor model and optimizer entries, from this rank's own copy; a tensor inside one
    # (get_extra_state's scales, a list of tensors in an optimizer's state) is read with it.
    value_nodes = {
        name: index.value(name, small_from)
        for name in index.value_names
        if (name.startswith("model/") and current_model is not None)
        or (name.startswith("optimizer/") and optimizer_plan is not None)
    }
    for source_rank, node in value_nodes.values():
        needed[source_rank].update(_tensor_refs(node, index, source_rank))

    prepared = Prepared(per_rank_from=own, resharded=resharded)
    live = _in_place_targets(index, targets, pieces, objects)
    try:  # the files kept open for the fill are let go on any way out but success
        loaded: dict[int, dict[int, torch.Tensor]] = {}
        for source_rank, entries in sorted(needed.items()):
            manifest, directory = index.manifests[source_rank], index.directory(source_rank)
            if live.get(source_rank):
                loaded[source_rank] = read_entries_into(
                    directory, manifest, entries, live[source_rank], prepared.fills, threads
                )
            else:
                loaded[source_rank] = read_entries(directory, manifest, entries, threads)
        assembled = {
            n: assemble(targets[n][1], found, loaded, DTYPES[index.items[n].dtype])
            for n, found in pieces.items()
        }
        # Each rank's tensors as a tree references them, built once per rank read from.
        values = {r: _values(index.manifests[r], loaded.get(r, {})) for r in needed}
        for name, source_rank, node in wanted:
            if node is not None:
                prepared.sections[name] = _decode(
                    node, values[source_rank], index, source_rank, name
                )
        decoded_values = {
            name: _decode(node, values[r], index, r, name)
            for name, (r, node) in value_nodes.items()
        }
        _check_sections(prepared, objects, version)
        if current_model is not None:
            prepared.model_state = {
                key: _value(f"model/{key}", assembled, targets, decoded_values)
                for key in current_model
            }
        if optimizer_plan is not None:
            prepared.optimizer_state = _optimizer_state(
                optimizer_plan, assembled, targets, prepared.sections, decoded_values, version
            )
        prepared.check(objects, version)
    except BaseException:
        prepared.release()
        raise
    return prepared


def _in_place_targets(
    index: SavedIndex,
    targets: dict[str, tuple[Placed, Box]],
    pieces: dict[str, list[tuple[ShardSource, Box]]],
    objects: TrainingObjects,
) -> dict[int, dict[str, torch.Tensor]]:
    """Per saved rank, ``{entry name: live tensor}`` of the tensors read straight into the
    live ones after every rank verified (``Prepared.fills``): those a single-process restore
    would fill in place (:func:`~pcframe.state.in_place.in_place_targets`: plain torch
    loading, the live storage itself, no ``step`` counters) that are stored whole in one
    entry (replicated state, or a box laid out as it was saved). The reader takes those
    whose dtype and shape match; the others are read into new tensors and copied by the
    apply. In place, the state is not allocated a second time nor copied after the read
    (with a fresh optimizer there is no live state: only the model's)."""
    allowed = in_place_targets(objects.model, objects.optimizer)
    live: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, found in pieces.items():
        placed, box = targets[name]
        # The single-process name: "optimizer/<i>/<key>" is "optimizer/state/<i>/<key>" there.
        section, _, rest = name.partition("/")
        target = allowed.get(f"{section}/state/{rest}" if section == "optimizer" else name)
        if target is None or placed.mesh is not None:
            continue
        if len(found) != 1 or found[0][0].box != box:
            continue
        source = found[0][0]
        live[source.rank][index.manifests[source.rank].entries[source.entry].name] = target
    return live


def _pieces(
    name: str, placed: Placed, box: Box, index: SavedIndex, rank: int, world_size: int
) -> list[tuple[ShardSource, Box]]:
    """The stored boxes that overlap this rank's ``box`` of ``name``, and their overlaps."""
    version, old_world = index.record.version, index.world_size
    item = index.items.get(name)
    if item is None:
        raise CheckpointError(f"global version {version} holds no tensor '{name}'")
    _check_shape(item, placed, old_world, world_size, version)
    # The stored boxes must tile the whole tensor (disjoint, nothing missing), whatever
    # this rank's box: overlapping boxes whose volumes add up would leave part of it unread.
    stored = [(s.box.offset, s.box.shape) for s in item.sources]
    problem = cover_problem(item.global_shape, stored)
    if problem is not None:
        raise ManifestError(
            f"global version {version}: the stored boxes of '{name}' (global shape "
            f"{list(item.global_shape)}) do not tile it: {problem}"
        )
    return [(s, cut) for s in item.sources if (cut := s.box.intersect(box)) is not None]


def _small_state(index: SavedIndex, own: int | None, small_from: int) -> list[tuple[str, int, Any]]:
    """(section, saved rank, encoded tree) of the small state this rank loads."""
    wanted: list[tuple[str, int, Any]] = [
        (name, small_from, index.section(small_from, name))
        for name in (Section.SCHEDULER, Section.SCALER, Section.EXTRA)
    ]
    optimizer_section = index.section(small_from, Section.OPTIMIZER)
    if isinstance(optimizer_section, dict):
        wanted.append(("param_groups", small_from, optimizer_section.get("param_groups")))
    if own is not None:  # per-rank state only from the same rank of the saved job
        wanted += [(name, own, index.section(own, name)) for name in PER_RANK]
    return wanted


def _optimizer_targets(
    index: SavedIndex,
    optimizer: torch.optim.Optimizer | None,
    targets: dict[str, tuple[Placed, Box]],
    version: int,
) -> dict[int, list[str]] | None:
    """Add a target per saved optimizer tensor; return {param index: [state keys]}."""
    if optimizer is None:
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    plan: dict[int, list[str]] = defaultdict(list)
    names = [n for n in (*index.items, *index.value_names) if n.startswith("optimizer/")]
    for name in names:
        _, raw_index, key = name.split("/", 2)
        if not raw_index.isdigit() or int(raw_index) >= len(params):
            raise CheckpointError(
                f"global version {version} has optimizer state for parameter {raw_index}, but "
                f"this optimizer has {len(params)} parameters; pass the same optimizer setup"
            )
        param = params[int(raw_index)]
        plan[int(raw_index)].append(key)
        item = index.items.get(name)
        if item is None:
            continue  # a non-tensor state value
        current = optimizer.state.get(param, {}).get(key)
        if isinstance(current, torch.Tensor):
            placed = placement_of(name, current)
        elif is_dtensor(param) and tuple(param.shape) == item.global_shape:
            # No state yet (fresh optimizer): state tensors shaped like the parameter follow
            # its layout, as every torch optimizer creates them.
            like = placement_of(name, param)
            placed = Placed(
                like.local, like.global_shape, like.box, like.writer, like.mesh, like.placements
            )
        else:
            placed = Placed(torch.empty(0), item.global_shape)
        targets[name] = (placed, placed.target_box)
    return dict(plan)


def _optimizer_state(
    plan: dict[int, list[str]],
    assembled: dict[str, torch.Tensor],
    targets: dict[str, tuple[Placed, Box]],
    sections: dict[str, Any],
    values: dict[str, Any],
    version: int,
) -> dict[str, Any]:
    groups = sections.pop("param_groups", None)
    if not isinstance(groups, list):
        raise CheckpointError(f"global version {version} holds no optimizer param_groups")
    state: dict[int, dict[str, Any]] = {}
    for param_index, keys in plan.items():
        state[param_index] = {
            key: _value(f"optimizer/{param_index}/{key}", assembled, targets, values)
            for key in keys
        }
    return {"state": state, "param_groups": groups}


def _value(
    name: str,
    assembled: dict[str, torch.Tensor],
    targets: dict[str, tuple[Placed, Box]],
    values: dict[str, Any],
) -> Any:
    """The loaded value of ``name``: its tensor rebuilt as placed now, or its plain value."""
    if name in assembled:
        return rebuild(assembled[name], targets[name][0])
    return values[name]


def _check_shape(item: SavedItem, placed: Placed, old: int, new: int, version: int) -> None:
    if item.global_shape == placed.global_shape:
        return
    message = (
        f"'{item.name}' has global shape {item.global_shape} in global version {version} "
        f"(saved by {old} ranks) but {placed.global_shape} in this job ({new} ranks)"
    )
    if (item.sharded or placed.sharded) and old != new:
        raise ReshardError(
            f"cannot reshard: {message}; sharded state is resharded only when its global shape "
            f"does not depend on the world size (e.g. no padding to a multiple of it): "
            f"restore with {old} ranks, or save it unpadded"
        )
    raise CheckpointError(f"{message}; pass objects of the same shapes that were checkpointed")


def _check_sections(prepared: Prepared, objects: TrainingObjects, version: int) -> None:
    for name in (Section.SCHEDULER, Section.SCALER):
        if getattr(objects, name) is not None and name not in prepared.sections:
            raise CheckpointError(
                f"global version {version} has no '{name}' state, but one was given; pass the "
                "same objects that were checkpointed"
            )
    states = prepared.sections.get(Section.STATEFUL)
    if prepared.per_rank_from is not None and objects.stateful:
        missing = sorted(set(objects.stateful) - set(states or {}))
        if missing:
            raise CheckpointError(
                f"global version {version} has no stateful object named {missing[0]!r}"
            )


def assemble(
    box: Box,
    found: list[tuple[ShardSource, Box]],
    loaded: dict[int, dict[int, torch.Tensor]],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Fill ``box`` from the ``(source, overlap)`` pieces; ``loaded[rank][entry]`` holds data."""
    if len(found) == 1 and found[0][0].box == box:
        source = found[0][0]
        return loaded[source.rank][source.entry]
    out = torch.empty(box.shape, dtype=dtype)  # an empty box (uneven shards) has no pieces
    for source, cut in found:
        data = loaded[source.rank][source.entry]
        out[cut.slices_within(box)] = data[cut.slices_within(source.box)]
    return out


def _values(manifest: Manifest, tensors: dict[int, torch.Tensor]) -> list[Any]:
    values: list[Any] = [None] * len(manifest.entries)
    for i, tensor in tensors.items():
        values[i] = tensor
    for i in manifest.numpy_tensors:
        if values[i] is not None:
            values[i] = values[i].numpy()
    return values


def _decode(node: Any, values: list[Any], index: SavedIndex, rank: int, name: str) -> Any:
    try:
        return decode_tree(node, values, path=f"/{name}")
    except ManifestError as exc:  # of its class: UnsupportedCheckpoint is no damage
        raise type(exc)(f"{index.directory(rank) / MANIFEST_NAME}: {exc}") from None


def _tensor_refs(node: Any, index: SavedIndex, rank: int) -> set[int]:
    """Entry indices of the tensors referenced in an encoded tree (validated)."""
    count = len(index.manifests[rank].entries)
    found: set[int] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            if len(current) == 1 and "$t" in current:
                ref = current["$t"]
                if isinstance(ref, bool) or not isinstance(ref, int) or not 0 <= ref < count:
                    where = index.directory(rank) / MANIFEST_NAME
                    raise ManifestError(f"{where}: tensor reference {ref!r} is out of range")
                found.add(ref)
            else:
                stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)
    return found


def _same_keys(current: set[str], saved: set[str], version: int, what: str) -> None:
    missing, unexpected = sorted(current - saved), sorted(saved - current)
    if missing or unexpected:
        raise CheckpointError(
            f"global version {version} does not fit this {what}: missing keys {missing[:5]}, "
            f"unexpected keys {unexpected[:5]}; pass the same {what} that was checkpointed "
            "(same wrapping, e.g. DDP's 'module.' prefix)"
        )
