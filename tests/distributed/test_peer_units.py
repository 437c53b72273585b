"""The peer tier's pieces: node placement, the verified shard stream between two real gloo
ranks, and the store's budget and retention."""

from __future__ import annotations

import filecmp
import multiprocessing
import os
import traceback
from pathlib import Path

import pytest
import torch

from pcframe import Checkpointer
from pcframe.distributed.nodes import NodeMap, backed_up_by, check_replicas, replica_ranks
from pcframe.errors import CorruptCheckpoint
from pcframe.format.stripes import stored_data_bytes
from pcframe.restore.reader import load_version
from pcframe.store.tiers.peer import PeerStore
from tests.distributed.launch import free_port
from tests.helpers import flip_byte

# --- where copies go ------------------------------------------------------------------------


def test_copies_go_to_the_same_position_on_the_next_nodes_never_the_own_node():
    nodes = NodeMap(("a", "a", "b", "b"))
    assert [replica_ranks(nodes, r, 1) for r in range(4)] == [(2,), (3,), (0,), (1,)]
    assert [backed_up_by(nodes, r, 1) for r in range(4)] == [(2,), (3,), (0,), (1,)]
    three = NodeMap(("a", "a", "b", "c", "c"))  # uneven nodes: positions wrap
    for rank in range(5):
        targets = replica_ranks(three, rank, 3)
        assert len(targets) == 2  # two other nodes: at most two safe copies
        assert all(not three.same_node(rank, t) for t in targets)
        assert len({three.node_of(t) for t in targets}) == 2
        for t in targets:
            assert rank in backed_up_by(three, t, 3)
    assert replica_ranks(NodeMap(("a", "a")), 0, 2) == ()  # one node: nowhere safe
    with pytest.raises(ValueError, match="replicas=4"):
        check_replicas(4)


# --- the shard stream, between two real ranks -------------------------------------------------


def _two_ranks(target, *args) -> list[object]:
    """Run ``target(rank, group, *args)`` on two gloo ranks; what each returned (or the
    traceback text of what it raised)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_rank_main, args=(rank, port, results, target, args))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    out: dict[int, object] = {}
    for _ in procs:
        rank, value = results.get(timeout=120)
        out[rank] = value
    for proc in procs:
        proc.join(timeout=30)
    return [out[0], out[1]]


def _rank_main(rank: int, port: int, results, target, args) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results.put((rank, target(rank, dist.group.WORLD, *args)))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _save(directory: Path, **engine) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    with Checkpointer(directory, model=model, optimizer=optimizer, **engine) as ckpt:
        ckpt.save(1).wait()
    return directory / "v00000001"


def _streams(rank, group, cases: list[tuple[str, str, str | None]]):
    """Each case (sent folder, receiving folder, pinned manifest checksum) in turn: rank 0
    sends, rank 1 receives; what rank 1 got of each."""
    from pcframe.distributed.shard_stream import receive_version, send_version

    outcomes = []
    for sent, received, pin in cases:
        if rank == 0:
            send_version(Path(sent), 1, group)
            continue
        try:
            manifest = receive_version(0, Path(received), group, pin)
            outcomes.append(("ok", manifest.version))
        except CorruptCheckpoint as exc:
            outcomes.append(("refused", str(exc)))
    return outcomes


def test_the_shard_stream_copies_verified_files_and_refuses_anything_else(tmp_path):
    """One pair of real gloo ranks, several transfers in a row (each must end on both sides,
    or the next one would read the rest of it):

    1-2. a plain version and a striped, coded one arrive byte for byte and verify;
    3. a damaged chunk is refused, naming the file and where;
    4. a manifest other than the pinned one is refused;
    5. a sender without the version says so;
    6. a sender whose data file is shorter than its manifest says sends zeros and says so
       at the end (the receiver refuses the copy);
    7. the stream is still in step: a good version after all that arrives.
    """
    plain = _save(tmp_path / "plain")
    coded = _save(tmp_path / "coded", stripes=2, codecs={"optimizer": "zstd"}, chunk_bytes=4096)
    damaged = _save(tmp_path / "damaged", chunk_bytes=4096)
    flip_byte(damaged / "data.bin", 5000)  # the second chunk
    short = _save(tmp_path / "short", chunk_bytes=4096)
    os.truncate(short / "data.bin", 4096)  # the first chunk only
    into = tmp_path / "in"
    cases = [
        (str(plain), str(into / "plain"), None),
        (str(coded), str(into / "coded"), None),
        (str(damaged), str(into / "damaged"), None),
        (str(plain), str(into / "pinned"), "0badc0de"),
        (str(tmp_path / "nothing"), str(into / "nothing"), None),
        (str(short), str(into / "short"), None),
        (str(coded), str(into / "again"), None),
    ]
    _, received = _two_ranks(_streams, cases)
    assert received[0] == ("ok", 1) and received[1] == ("ok", 1), received
    for sent, name in ((plain, "plain"), (coded, "coded")):
        copy = into / name
        assert sorted(os.listdir(copy)) == sorted(os.listdir(sent))
        for file in os.listdir(sent):
            assert filecmp.cmp(sent / file, copy / file, shallow=False), (name, file)
        load_version(copy, version=1)  # every chunk checksummed again by the engine's reader
    assert received[2][0] == "refused", received[2]
    assert "data.bin: checksum mismatch at byte 4096" in received[2][1]
    assert received[3][0] == "refused" and "the record pins" in received[3][1], received[3]
    assert received[4][0] == "refused" and "no readable copy" in received[4][1], received[4]
    assert received[5][0] == "refused", received[5]
    assert "could not read its files" in received[5][1] or "checksum" in received[5][1]
    assert received[6] == ("ok", 1), received[6]


# --- the store ---------------------------------------------------------------------------------


def _copy_in(store: PeerStore, src: int, version: int, source: Path) -> None:
    staging = store.staging(src, version)
    staging.mkdir(parents=True)
    for name in os.listdir(source):
        (staging / name).write_bytes((source / name).read_bytes())
    store.commit(src, version, staging)


def _store_of_three(tmp_path: Path, budget_copies: int, keep: int) -> tuple[PeerStore, int, Path]:
    """A store given copies of versions 1, 2, 3 of rank 0, the size of one copy, and the
    version directory copied."""
    sent = _save(tmp_path / "sender")
    size = stored_data_bytes(sent)
    store = PeerStore(tmp_path / "peers", budget=budget_copies * size, keep=keep)
    for version in (1, 2, 3):
        assert store.make_room(size)
        _copy_in(store, 0, version, sent)
    return store, size, sent


def test_the_store_keeps_the_newest_per_rank_and_stays_within_its_budget(tmp_path):
    store, size, sent = _store_of_three(tmp_path, budget_copies=3, keep=2)
    assert store.held() == {0: [2, 3]}  # keep=2
    assert store.make_room(size)
    _copy_in(store, 1, 1, sent)
    assert store.held_bytes() <= store.budget
    # A fourth copy fits only by dropping an old one; the newest of each rank stays.
    assert store.make_room(size)
    assert store.held() == {0: [3], 1: [1]}
    assert not store.make_room(4 * size)  # larger than the whole budget: declined
    assert store.held() == {0: [3], 1: [1]}  # declining costs nothing


def test_room_for_a_delta_chain_is_made_at_once_and_keeps_the_bases_it_reads(tmp_path):
    """Room for two missing copies at once (a delta version and its missing base) prunes for
    both; a held version the incoming chain reads stays even when it is the oldest."""
    store, size, _ = _store_of_three(tmp_path, budget_copies=4, keep=3)
    # 3 held + 2 incoming > 4: two copies' room needed; v1 is read by the incoming chain.
    assert store.make_room(2 * size, reads=[(0, 1)])
    assert store.held() == {0: [1, 3]}  # v2 went (to the spare), not v1
    assert store.held_bytes() + max(store.spare_bytes(), 2 * size) <= store.budget
    assert not store.make_room(3 * size, reads=[(0, 1)])  # v1 and v3 (newest) both stay


def _store_backing_up_two(tmp_path: Path, budget_copies: int) -> tuple[PeerStore, int]:
    """Versions 1-3 of rank 0 (keep 3) and version 1 of rank 1 held; the size of a copy."""
    store, size, sent = _store_of_three(tmp_path, budget_copies=budget_copies, keep=3)
    assert store.make_room(size)
    _copy_in(store, 1, 1, sent)
    assert store.held() == {0: [1, 2, 3], 1: [1]}
    return store, size


def test_room_for_two_ranks_chains_is_made_together(tmp_path):
    """Two backed-up ranks offer at once: room is made for both chains together, so the
    copies fit in the budget while both arrive (each chain alone fits)."""
    store, size = _store_backing_up_two(tmp_path, budget_copies=5)
    # Rank 0: a delta version 5 on its held version 1; rank 1: a full version 6.
    answer = store.admit({0: [(1, size), (5, size)], 1: [(6, size)]})
    assert answer == {0: [5], 1: [6]}
    assert store.held_bytes() + max(store.spare_bytes(), 2 * size) <= store.budget
    assert 1 in store.held()[0]  # the base rank 0's delta reads


def test_room_made_for_one_rank_never_prunes_a_base_another_ranks_chain_reads(tmp_path):
    """Rank 1's chain does not fit beside rank 0's without pruning the version 1 that rank
    0's incoming delta reads: rank 1's is declined, and that base stays."""
    store, size = _store_backing_up_two(tmp_path, budget_copies=4)
    answer = store.admit({0: [(1, size), (5, size)], 1: [(5, size), (6, size)]})
    assert answer == {0: [5], 1: None}
    assert store.held() == {0: [1, 3], 1: [1]}  # version 2 made the room; 1 stays
    assert store.held_bytes() + max(store.spare_bytes(), size) <= store.budget
    assert store.admit({0: [(1, size), (3, size)]}) == {0: []}  # held: nothing to receive


def test_half_received_copies_are_swept_at_start(tmp_path):
    store = PeerStore(tmp_path / "peers", budget=1 << 20)
    staging = store.staging(2, 5)
    staging.mkdir(parents=True)
    (staging / "data.bin").write_bytes(b"x")
    again = PeerStore(tmp_path / "peers", budget=1 << 20)
    assert again.swept == ["rank-2/v00000005.tmp"] and again.held() == {}


# --- fetched shards ---------------------------------------------------------------------------


def test_a_restore_keeps_one_fetched_version_in_memory_and_reads_old_fetches_on_disk(tmp_path):
    """With a peer tier, shards a restore fetches go into the node's memory folder (not the
    root's disk), are listed as fetched (not as peer copies), and once a version is restored
    only its shards stay there: older fetches and half-received leftovers go."""
    from types import SimpleNamespace

    from pcframe.distributed.recovery import FETCHED, FETCHED_IN_MEMORY, Kind, Place

    def shard_dir(folder: Path, src: int, version: int) -> Path:
        path = folder / f"rank-{src}" / f"v{version:08d}"
        path.mkdir(parents=True)
        (path / "manifest.json").write_text("{}")  # complete for listing (never read here)
        return path

    root, peer_base = tmp_path / "root", tmp_path / "shm"
    place = Place(root, peer_base, peer_base / FETCHED_IN_MEMORY)
    assert place.fetch_path(2, 5).is_relative_to(peer_base / FETCHED_IN_MEMORY)
    shard_dir(peer_base / FETCHED_IN_MEMORY, 2, 5)
    shard_dir(peer_base / FETCHED_IN_MEMORY, 2, 4)
    shard_dir(peer_base / FETCHED_IN_MEMORY, 3, 5)
    (peer_base / FETCHED_IN_MEMORY / "rank-3" / "v00000006.tmp").mkdir()
    shard_dir(peer_base / "kept-by-rank-0", 2, 5)
    shard_dir(root / FETCHED, 1, 3)  # an earlier restore's fetch into the root: still read
    assert place.find(2, 5) == (Kind.FETCHED, peer_base / FETCHED_IN_MEMORY / "rank-2/v00000005")
    assert place.find(1, 3)[0] is Kind.FETCHED
    assert place.readable() == {2: {5: 0, 4: 0}, 3: {5: 0}, 1: {3: 0}}
    record = SimpleNamespace(
        shards=[SimpleNamespace(rank=2, version=5), SimpleNamespace(rank=3, version=5)]
    )
    place.keep_fetched(record)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("*/*/rank-*/*"))
    assert left == [
        "shm/fetched/rank-2/v00000005",
        "shm/fetched/rank-3/v00000005",
        "shm/kept-by-rank-0/rank-2/v00000005",  # the peer tier's own copies are not a cache
    ]
    assert not list((root / FETCHED).glob("rank-*/*"))


def _fetch_places(rank, group, root: str, memory: str):
    """Both ranks share a root and a node; rank 1 asks for more room than any disk has."""
    from pcframe.distributed.recovery import Place, Recovery

    out = []
    for needs in ((0, 0), (0, 1 << 62)):
        recovery = Recovery(Place(Path(root)), [0, 0], rank, group)
        recovery.fetch_in_memory(Path(memory), "node-a", needs[rank])
        out.append((str(recovery.place.fetch_into), recovery.fetchers))
    return out


@pytest.mark.slow
def test_a_restore_fetches_into_memory_only_where_the_version_fits(tmp_path):
    """Ranks that share a root and a node fetch each shard once, into the node's memory; a
    rank whose memory cannot hold the newest version fetches into the root instead, and so
    it no longer shares a fetched folder with the others (each group fetches for itself)."""
    from pcframe.distributed.recovery import FETCHED

    root, memory = tmp_path / "root", tmp_path / "shm" / "fetched" / "key"
    results = _two_ranks(_fetch_places, str(root), str(memory))
    for rank, got in enumerate(results):
        assert isinstance(got, list), got  # else the traceback
        (both_fit, fitting), (one_fits, fitting_then) = got
        assert both_fit == str(memory) and fitting == [0, 0]
        expected = str(memory) if rank == 0 else str(root / FETCHED)
        assert one_fits == expected and fitting_then == [0, 1]


def _full_memory(rank, group, sent: str, into: str):
    """Rank 1's writes fail as on a full /dev/shm for the first copy, then succeed."""
    import errno

    from pcframe.distributed import shard_stream

    if rank == 0:
        shard_stream.send_version(Path(sent), 1, group)
        shard_stream.send_version(Path(sent), 1, group)
        return None
    real = os.pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.pwrite = full
    try:
        shard_stream.receive_version(0, Path(into) / "first", group)
        first = "received"
    except CorruptCheckpoint as exc:
        first = str(exc)
    finally:
        os.pwrite = real
    second = shard_stream.receive_version(0, Path(into) / "second", group).version
    return first, second


def test_a_copy_that_cannot_be_written_is_refused_and_the_stream_stays_in_step(tmp_path):
    sent = _save(tmp_path / "sent", chunk_bytes=4096)  # several pieces after the failing one
    _, (first, second) = _two_ranks(_full_memory, str(sent), str(tmp_path / "in"))
    assert "cannot write the copy" in first and "No space left on device" in first, first
    assert second == 1  # every piece of the refused copy was drained: the next one arrives


# --- copies written over the files of dropped ones -----------------------------------------


def _into_spares(rank, group, sent: list[str], into: str, spares: list[str]):
    """Rank 0 sends each version; rank 1 receives each into ``into/<i>`` over the files of
    ``spares[i]``."""
    from pcframe.distributed.shard_stream import receive_version, send_version

    if rank == 0:
        for directory in sent:
            send_version(Path(directory), 1, group)
        return None
    return [
        receive_version(0, Path(into) / str(i), group, spare=Path(spare)).version
        for i, spare in enumerate(spares)
    ]


def test_a_copy_received_over_spare_files_is_the_senders_files_exactly(tmp_path):
    """Spare files larger and smaller than the copy's, full of other bytes, become the copy's
    files (the same inodes: their pages are reused) and read back as the sender's files byte
    for byte; a link among the spares is never written through."""
    plain = _save(tmp_path / "plain")
    coded = _save(tmp_path / "coded", stripes=2, codecs={"optimizer": "zstd"}, chunk_bytes=4096)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not yours" * 1000)
    spares = []
    for i, source in enumerate((plain, coded)):
        spare = tmp_path / f"spare-{i}"
        spare.mkdir()
        largest = max(os.path.getsize(source / n) for n in os.listdir(source))
        (spare / "old-big").write_bytes(b"\xff" * (2 * largest))
        (spare / "old-small").write_bytes(b"\xee" * 100)
        (spare / "zz-link").symlink_to(outside)
        spares.append(spare)
    inodes = [os.stat(spare / "old-big").st_ino for spare in spares]
    into = tmp_path / "in"
    _, got = _two_ranks(_into_spares, [str(plain), str(coded)], str(into), list(map(str, spares)))
    assert got == [1, 1], got
    for i, source in enumerate((plain, coded)):
        copy = into / str(i)
        assert sorted(os.listdir(copy)) == sorted(os.listdir(source))
        for name in os.listdir(source):
            assert filecmp.cmp(source / name, copy / name, shallow=False), (i, name)
        assert os.stat(copy / "data.bin").st_ino == inodes[i]  # the largest spare, reused
        load_version(copy, version=1)
    assert outside.read_bytes() == b"not yours" * 1000


def _copies_through_a_store(rank, group, sent: str, directory: str, budget: int, keep: int):
    """Rank 0 sends its version 6 times; rank 1 takes each as replication does (room, staging,
    receive over the spare, commit) and reports, after each, the bytes of every file under
    the store and whether the copy's data file is one the store held before."""
    from pcframe.distributed.shard_stream import receive_version, send_version
    from pcframe.store.tiers.peer import PeerStore

    rounds = 6
    if rank == 0:
        for _ in range(rounds):
            send_version(Path(sent), 1, group)
        return None
    store = PeerStore(Path(directory), budget=budget, keep=keep)
    size = stored_data_bytes(Path(sent))
    seen, out = set(), []
    for version in range(1, rounds + 1):
        assert store.make_room(size)
        staging = store.staging(0, version)
        receive_version(0, staging, group, spare=store.spare)
        store.commit(0, version, staging)
        inode = os.stat(store.path(0, version) / "data.bin").st_ino
        total = sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())
        out.append((inode in seen, total, store.held()[0]))
        seen |= {p.stat().st_ino for p in Path(directory).rglob("*.bin")}
    return out


@pytest.mark.parametrize("budget_copies, keep", [(2.5, 2), (10, 1)])
def test_a_store_receives_into_the_pages_of_the_copies_it_drops(tmp_path, budget_copies, keep):
    """Whether copies are dropped for room (a budget of 2.5 copies) or beyond ``keep``, each
    copy after the first ones is written over a dropped copy's files, and every file under
    the store (the spare included) stays within the budget after each copy."""
    sent = _save(tmp_path / "sent")
    size = stored_data_bytes(sent)
    manifest = os.path.getsize(sent / "manifest.json")
    budget = int(budget_copies * size)
    _, got = _two_ranks(_copies_through_a_store, str(sent), str(tmp_path / "peers"), budget, keep)
    assert isinstance(got, list), got
    # The store first drops a copy for the third (room) or on committing the second (keep):
    # from the third on, every copy is written over the files of one dropped.
    assert [reused for reused, _, _ in got] == [False, False, True, True, True, True], got
    for i, (_, total, held) in enumerate(got):
        assert total <= budget + (keep + 1) * manifest, (total, budget)  # manifests not counted
        assert held == list(range(max(1, i + 2 - keep), i + 2)), (i, held)
