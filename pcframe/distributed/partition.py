"""Which rank writes each replicated tensor: every tensor once, the bytes spread evenly."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence


def assign_owners(
    sizes: Iterable[tuple[str, int]], world_size: int, base_loads: Sequence[int] | None = None
) -> dict[str, int]:
    """Greedy largest-first assignment of named tensors to ranks, balancing bytes.

    The result depends only on the (name, size) pairs, the world size and the base loads, so
    every rank computes the same owners without talking to the others. ``base_loads`` are the
    bytes each rank already writes (its shards of sharded state), so replicated state fills
    the gaps. Ties go to the lower rank; names break ties between equal sizes.

    Raises:
        ValueError: for a world size below 1, negative sizes, duplicate names, or base loads
            of the wrong length.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = list(base_loads) if base_loads is not None else [0] * world_size
    if len(loads) != world_size:
        raise ValueError(f"base_loads has {len(loads)} entries for world_size {world_size}")
    items = sorted(sizes, key=lambda item: (-item[1], item[0]))
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    owners: dict[str, int] = {}
    for name, size in items:
        if size < 0:
            raise ValueError(f"tensor {name!r} has a negative size {size}")
        if name in owners:
            raise ValueError(f"tensor name {name!r} appears twice")
        load, rank = heapq.heappop(heap)
        owners[name] = rank
        heapq.heappush(heap, (load + size, rank))
    return owners
