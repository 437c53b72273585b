"""The order a restore's transfers run in: every rank runs its own in the plan's order, and a
send blocks until its receiver takes it, so the order decides how many run at once."""

from __future__ import annotations

import random

from pcframe.distributed.global_versions import GlobalRecord, ShardRef
from pcframe.distributed.recovery import Holdings, Transfer, in_steps, plan_round


def _turns(transfers: list[Transfer]) -> int:
    """How many turns the transfers take when each rank runs its own in the list's order and
    a transfer runs once both its ranks are at it (one turn each); fails on a deadlock."""
    queues: dict[int, list[Transfer]] = {}
    for t in transfers:
        queues.setdefault(t.sender, []).append(t)
        queues.setdefault(t.receiver, []).append(t)
    left, turns = set(transfers), 0
    while left:
        ready = {
            t
            for t in left
            if queues[t.sender] and queues[t.sender][0] == t and queues[t.receiver][0] == t
        }
        assert ready, f"deadlock with {len(left)} transfers left"
        for t in ready:
            queues[t.sender].pop(0)
            queues[t.receiver].pop(0)
        left -= ready
        turns += 1
    return turns


def _record(world: int) -> GlobalRecord:
    shards = tuple(ShardRef(r, f"rank-{r}", 3, 9, "0" * 8, 1 << 27) for r in range(world))
    return GlobalRecord(3, 9, 0.0, world, shards)


def test_a_lost_nodes_restore_runs_as_many_transfers_at_once_as_the_ranks_allow():
    # Four nodes of one rank each (a root per node), the peer copy of each rank's shard in
    # the next node's memory; node 0 came back empty. Every root lacks the shards of the
    # others (data parallel: every rank reads every shard). The busiest rank takes part in
    # 6 transfers: 6 turns at best. Ordered by sender, a rank's first transfer often waited
    # for a partner busy with another rank, and the ten transfers took 9 turns.
    holdings = [Holdings(r, {} if r == 0 else {r: {3: 0}, r - 1: {3: 0}}) for r in range(4)]
    transfers, downloads, missing = plan_round(_record(4), holdings, [0, 1, 2, 3])
    assert not downloads and not missing and len(transfers) == 10
    busiest = max(sum(r in (t.sender, t.receiver) for t in transfers) for r in range(4))
    assert busiest == 6
    assert _turns(transfers) == busiest


def test_any_set_of_transfers_runs_within_twice_its_busiest_ranks_share_and_never_deadlocks():
    rng = random.Random(7)
    for _ in range(300):
        world = rng.randint(2, 9)
        transfers = {
            Transfer(s, r, rng.randrange(world), rng.randint(1, 3))
            for _ in range(rng.randint(1, 20))
            if (s := rng.randrange(world)) != (r := rng.randrange(world))
        }
        if not transfers:
            continue
        ordered = in_steps(list(transfers))
        assert sorted(ordered, key=repr) == sorted(transfers, key=repr)
        # the busiest rank bounds it from below; greedy colouring stays within twice that
        busiest = max(
            sum(rank in (t.sender, t.receiver) for t in transfers) for rank in range(world)
        )
        turns = _turns(ordered)
        assert busiest <= turns <= 2 * busiest - 1
