"""Which ranks share a node, and which ranks on other nodes keep copies of each rank's shard.

A spot preemption takes a whole VM: every rank on it, its local disk and its memory. A copy
is safe from that only on another node, so the peer tier needs to know which ranks share a
node. The launcher says so: torchrun sets ``GROUP_RANK`` (the node's rank) on every worker;
without a launcher the host name does. ``PCFRAME_NODE`` (or ``node=``) overrides both, so
tests run several "nodes" as process groups on one machine, each with its own folders.

:func:`replica_ranks` places the copies: rank ``r`` at position ``i`` among its node's
ranks is copied to the ranks at position ``i`` of the next ``replicas`` nodes (wrapping
around; a node with fewer ranks takes position ``i`` modulo its size), so every node sends
and receives about as much as every other, and no copy lands on its own node.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

NODE_ENV = "PCFRAME_NODE"
MAX_REPLICAS = 3


def node_key(node: str | None = None) -> str:
    """This process's node: ``node`` if given, else ``PCFRAME_NODE``, else torchrun's node
    rank with the host name, else the host name."""
    if node:
        return str(node)
    if os.environ.get(NODE_ENV):
        return os.environ[NODE_ENV]
    host = socket.gethostname()
    group_rank = os.environ.get("GROUP_RANK")
    return f"{host}/{group_rank}" if group_rank is not None else host


@dataclass(frozen=True)
class NodeMap:
    """The node of every rank (from each rank's :func:`node_key`, all-gathered)."""

    keys: tuple[str, ...]  # per rank

    @property
    def world_size(self) -> int:
        return len(self.keys)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node keys in order of their lowest rank."""
        return tuple(dict.fromkeys(self.keys))

    def node_of(self, rank: int) -> int:
        """The index of ``rank``'s node in :attr:`nodes`."""
        return self.nodes.index(self.keys[rank])

    def ranks_on(self, node: int) -> tuple[int, ...]:
        key = self.nodes[node]
        return tuple(r for r, k in enumerate(self.keys) if k == key)

    def leader(self, node: int) -> int:
        """The node's lowest rank (it writes what the node keeps once, e.g. record copies)."""
        return self.ranks_on(node)[0]

    def same_node(self, a: int, b: int) -> bool:
        return self.keys[a] == self.keys[b]


def replica_ranks(nodes: NodeMap, rank: int, replicas: int) -> tuple[int, ...]:
    """The ranks on other nodes that keep copies of ``rank``'s shard (at most one per node,
    ``min(replicas, nodes - 1)`` of them: with one node there is nowhere safe to copy to)."""
    node = nodes.node_of(rank)
    position = nodes.ranks_on(node).index(rank)
    count = len(nodes.nodes)
    chosen = []
    for hop in range(1, min(replicas, count - 1) + 1):
        others = nodes.ranks_on((node + hop) % count)
        chosen.append(others[position % len(others)])
    return tuple(chosen)


def backed_up_by(nodes: NodeMap, rank: int, replicas: int) -> tuple[int, ...]:
    """The ranks whose shards ``rank`` keeps copies of (the inverse of :func:`replica_ranks`)."""
    return tuple(
        other for other in range(nodes.world_size) if rank in replica_ranks(nodes, other, replicas)
    )


def check_replicas(replicas: int) -> int:
    """``replicas`` if it is 0 (no peer copies) to :data:`MAX_REPLICAS`.

    Raises:
        ValueError: naming the argument and the range.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise ValueError(f"replicas={replicas!r}: give an int from 0 to {MAX_REPLICAS}")
    if not 0 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"replicas={replicas}: give 0 (no peer copies) to {MAX_REPLICAS}")
    return replicas


def spread(loads: Sequence[int], candidates: Sequence[int]) -> int:
    """The candidate with the least load so far (the lowest on a tie): who sends next."""
    return min(candidates, key=lambda c: (loads[c], c))
