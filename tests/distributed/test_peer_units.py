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
from pcframe.format.manifest import manifest_crc
from pcframe.restore.reader import load_version
from pcframe.store.tiers.peer import PeerStore, copy_bytes
from tests.distributed.launch import free_port
from tests.helpers import flip_byte


def _crc(version_dir: Path) -> str:
    """What a global record pins a shard by (and a peer copy is matched against)."""
    return manifest_crc(version_dir / "manifest.json")


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


def _streams(rank, group, cases: list[tuple[str, str, str | None, int | None]]):
    """Each case (sent folder, receiving folder, pinned manifest checksum, size limit) in
    turn: rank 0 sends, rank 1 receives; what rank 1 got of each."""
    from pcframe.distributed.shard_stream import receive_version, send_version

    outcomes = []
    for sent, received, pin, limit in cases:
        if rank == 0:
            send_version(Path(sent), 1, group)
            continue
        try:
            manifest = receive_version(0, Path(received), group, pin, limit=limit)
            outcomes.append(("ok", manifest.version))
        except (CorruptCheckpoint, OSError) as exc:
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
    7. a receiver that cannot make the copy's folder refuses it before its pieces come
       (before the go/refuse answer, such a refusal left the sender streaming into a
       receiver posting nothing, and gloo aborted the process);
    8. a copy larger than the room made for it is refused on its manifest;
    9-10. a sender whose data file is a folder, or a link, sends zeros and says so (it
       raised ``NotRegularFile`` out of the stream, its receiver waiting on the rest);
    11. the stream is still in step: a good version after all that arrives.
    """
    plain = _save(tmp_path / "plain")
    coded = _save(tmp_path / "coded", stripes=2, codecs={"optimizer": "zstd"}, chunk_bytes=4096)
    damaged = _save(tmp_path / "damaged", chunk_bytes=4096)
    flip_byte(damaged / "data.bin", 5000)  # the second chunk
    short = _save(tmp_path / "short", chunk_bytes=4096)
    os.truncate(short / "data.bin", 4096)  # the first chunk only
    into = tmp_path / "in"
    blocked = tmp_path / "a-file"
    blocked.write_bytes(b"not a folder")
    folder = _save(tmp_path / "folder")
    os.remove(folder / "data.bin")
    os.mkdir(folder / "data.bin")
    link = _save(tmp_path / "link")
    os.remove(link / "data.bin")
    os.symlink(plain / "data.bin", link / "data.bin")  # the right bytes, behind a link
    cases = [
        (str(plain), str(into / "plain"), None, None),
        (str(coded), str(into / "coded"), None, None),
        (str(damaged), str(into / "damaged"), None, None),
        (str(plain), str(into / "pinned"), "0badc0de", None),
        (str(tmp_path / "nothing"), str(into / "nothing"), None, None),
        (str(short), str(into / "short"), None, None),
        (str(plain), str(blocked / "copy"), None, None),
        (str(plain), str(into / "too-big"), None, 1000),
        (str(folder), str(into / "folder"), None, None),
        (str(link), str(into / "link"), None, None),
        (str(coded), str(into / "again"), None, None),
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
    assert received[6][0] == "refused" and "a-file" in received[6][1], received[6]
    assert received[7][0] == "refused" and "more than the 1000" in received[7][1], received[7]
    assert not (into / "too-big" / "data.bin").exists()  # nothing reserved for it
    for outcome in received[8:10]:  # the zeros fail their checksums first
        assert outcome[0] == "refused", outcome
        assert "could not read its files" in outcome[1] or "checksum" in outcome[1], outcome
    assert received[10] == ("ok", 1), received[10]


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
    size = copy_bytes(sent)
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
    answer = store.admit({0: [(1, size, ""), (5, size, "")], 1: [(6, size, "")]})
    assert answer == {0: [5], 1: [6]}
    assert store.held_bytes() + max(store.spare_bytes(), 2 * size) <= store.budget
    assert 1 in store.held()[0]  # the base rank 0's delta reads


def test_room_made_for_one_rank_never_prunes_a_base_another_ranks_chain_reads(tmp_path):
    """Rank 1's chain does not fit beside rank 0's without pruning the version 1 that rank
    0's incoming delta reads: rank 1's is declined, and that base stays."""
    store, size = _store_backing_up_two(tmp_path, budget_copies=4)
    answer = store.admit({0: [(1, size, ""), (5, size, "")], 1: [(5, size, ""), (6, size, "")]})
    assert answer == {0: [5], 1: None}
    assert store.held() == {0: [1, 3], 1: [1]}  # version 2 made the room; 1 stays
    assert store.held_bytes() + max(store.spare_bytes(), size) <= store.budget
    assert store.admit({0: [(1, size, ""), (3, size, "")]}) == {0: []}  # held: nothing to receive


def test_every_file_of_a_copy_counts_against_the_budget(tmp_path):
    """A coded version keeps its tensors in codec.bin, not data.bin: the budget counts every
    file of a copy (codec segments and manifest too), so a store never holds more than it
    (counting the data stripes alone, a fully coded shard took 0 bytes of the budget)."""
    coded = _save(tmp_path / "coded", codecs={"*": "zstd"})
    on_disk = sum(p.stat().st_size for p in coded.iterdir())
    assert copy_bytes(coded) == on_disk
    assert os.path.getsize(coded / "data.bin") < on_disk / 2  # mostly codec.bin
    store = PeerStore(tmp_path / "peers", budget=int(2.5 * on_disk), keep=5)
    for version in (1, 2, 3):
        answer = store.admit({0: [(version, copy_bytes(coded), _crc(coded))]})
        assert answer == {0: [version]}
        _copy_in(store, 0, version, coded)
        assert store.held_bytes() + store.spare_bytes() <= store.budget
    assert store.held() == {0: [2, 3]}  # keep=5, but room for two and the one arriving
    assert store.admit({0: [(4, 3 * on_disk, "")]}) == {0: None}  # over the budget: declined


def test_the_default_budget_is_shared_by_the_ranks_of_a_node(tmp_path):
    """Without peer_budget each rank takes a share of half the free memory, so the ranks of
    one node together stay within it (each taking half would over-commit /dev/shm)."""
    one = PeerStore(tmp_path / "one")
    four = PeerStore(tmp_path / "four", sharers=4)
    assert four.budget == pytest.approx(one.budget / 4, rel=0.02)
    assert 4 * four.budget <= one.budget * 1.02


def test_the_pinned_versions_copies_stay_beyond_keep_and_when_room_is_made(tmp_path):
    """The replication pins the newest version secured on every peer: its copy stays while
    newer copies come and go (beyond keep, and when room is made), until another is pinned,
    so a node lost while newer rounds are incomplete still has a version to come back to."""
    sent = _save(tmp_path / "sender")
    size = copy_bytes(sent)
    store = PeerStore(tmp_path / "peers", budget=3 * size, keep=1)
    assert store.make_room(size)
    _copy_in(store, 0, 1, sent)
    store.pin(1)
    for version in (2, 3, 4):
        assert store.make_room(size)
        _copy_in(store, 0, version, sent)
        assert store.held() == {0: [1, version]}  # keep=1, and the pinned one
    # Room for two copies: the newest copy is not known to be part of a whole version and
    # gives way; the pinned one stays (and nothing else can go for more).
    assert store.make_room(2 * size)
    assert store.held() == {0: [1]}
    assert not store.make_room(3 * size)
    _copy_in(store, 0, 5, sent)
    store.pin(5)  # a newer version secured: the old pin's copy may go
    assert store.make_room(2 * size)
    assert store.held() == {0: [5]}


def test_one_failed_round_does_not_stop_a_tight_store_for_good(tmp_path):
    """A round that failed somewhere leaves the pin on an older version while a newer copy
    arrived here. With room for two and a half copies (the recovery benchmark's budget), the
    next copy must still fit: the unsecured newer copy gives way, not the pinned one. Had
    both stayed, every later copy would be declined, no round could be whole again, and the
    pin would never move."""
    sent = _save(tmp_path / "sender")
    size = copy_bytes(sent)
    store = PeerStore(tmp_path / "peers", budget=int(2.5 * size), keep=2)
    for version in (4, 5):
        assert store.make_room(size)
        _copy_in(store, 0, version, sent)
    store.pin(4)  # round 5 failed on another rank: 4 is the newest secured
    assert store.admit({0: [(6, size, "")]}) == {0: [6]}
    _copy_in(store, 0, 6, sent)
    assert store.held() == {0: [4, 6]}
    assert store.held_bytes() + store.spare_bytes() <= store.budget


def test_a_held_copy_of_another_shard_with_the_offered_number_is_dropped(tmp_path):
    """A job started again at the same root numbers its versions from 1 again; a copy of
    the earlier job's version 1 left in /dev/shm is not the offered version 1: admit drops
    it and asks for the offered one (before, it answered 'held', and the version counted as
    safe on its peer while no copy of it existed)."""
    earlier = _save(tmp_path / "earlier")
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 8)
    with Checkpointer(tmp_path / "later", model=model) as ckpt:
        ckpt.save(1).wait()
    later = tmp_path / "later" / "v00000001"
    assert _crc(earlier) != _crc(later)
    store = PeerStore(tmp_path / "peers", budget=1 << 24)
    _copy_in(store, 0, 1, earlier)
    assert store.admit({0: [(1, copy_bytes(later), _crc(earlier))]}) == {0: []}
    assert store.admit({0: [(1, copy_bytes(later), _crc(later))]}) == {0: [1]}
    assert store.held() == {}  # the earlier job's copy is gone


def test_while_a_restore_reads_the_nodes_copies_none_is_overwritten_in_place(tmp_path):
    """A copy let go becomes the spare, whose files the next copy truncates and overwrites in
    place: a restore of any rank of the node reading (or sending from a map of) that copy
    would read other bytes or fault. While a restore reads (another rank's store holds the
    marker: the stores of a node share a folder), a copy let go is deleted instead, which
    leaves every open descriptor and map of it readable."""
    sent = _save(tmp_path / "sender")
    size = copy_bytes(sent)
    mine = PeerStore(tmp_path / "peers" / "kept-by-rank-0", budget=2 * size, keep=1)
    other = PeerStore(tmp_path / "peers" / "kept-by-rank-1", budget=1 << 24)
    _copy_in(mine, 0, 1, sent)
    copy = mine.path(0, 1) / "data.bin"
    with open(copy, "rb") as reader, other.reading():
        before = reader.read()
        reader.seek(0)
        _copy_in(mine, 0, 2, sent)  # keep=1: version 1 goes, deleted, not the spare
        assert mine.held() == {0: [2]} and not mine.spare.exists()
        assert reader.read() == before  # the reader's file is untouched
    assert not any(p.name.startswith(".reading-") for p in (tmp_path / "peers").iterdir())
    _copy_in(mine, 0, 3, sent)  # no restore now: version 2 becomes the spare
    assert mine.held() == {0: [3]} and mine.spare.exists()


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
    from pcframe.store.tiers.peer import PeerStore, copy_bytes

    rounds = 6
    if rank == 0:
        for _ in range(rounds):
            send_version(Path(sent), 1, group)
        return None
    store = PeerStore(Path(directory), budget=budget, keep=keep)
    size = copy_bytes(Path(sent))
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
    size = copy_bytes(sent)
    budget = int(budget_copies * size)
    _, got = _two_ranks(_copies_through_a_store, str(sent), str(tmp_path / "peers"), budget, keep)
    assert isinstance(got, list), got
    # The store first drops a copy for the third (room) or on committing the second (keep):
    # from the third on, every copy is written over the files of one dropped.
    assert [reused for reused, _, _ in got] == [False, False, True, True, True, True], got
    for i, (_, total, held) in enumerate(got):
        assert total <= budget, (total, budget)  # every file counts, manifests included
        assert held == list(range(max(1, i + 2 - keep), i + 2)), (i, held)


# --- the rounds ------------------------------------------------------------------------------


def _round_that_fails(rank, group, directory: str):
    """Both ranks replicate a version whose folder lookup fails with an error that is not
    the stream's (a ValueError here): what ``wait`` and the status say afterwards."""
    import time

    from pcframe.distributed.global_versions import GlobalRecord, ShardRef
    from pcframe.distributed.replication import PeerReplication

    def shard_dir(version: int) -> Path:
        raise ValueError(f"no folder for version {version}")

    store = PeerStore(Path(directory) / f"rank-{rank}", budget=1 << 20)
    shards = tuple(ShardRef(r, f"rank-{r}", 1, 1, f"{r:08x}", 1) for r in range(2))
    peers = PeerReplication(NodeMap(("a", "b")), rank, 1, store, shard_dir, group)
    peers.submit(GlobalRecord(1, 1, 0.0, 2, shards))
    began = time.monotonic()
    decided = peers.wait(1, timeout=60)
    took = time.monotonic() - began
    peers.close()
    return decided, took, peers.status.broken, sorted(peers.protected()), peers.copied(1)


def test_any_error_in_a_round_stops_replication_and_releases_its_waiters(tmp_path):
    """An error in a round other than a broken stream (here a ValueError) used to end the
    round thread silently: ``wait`` then blocked (a preemption notice waits on it), the
    version stayed protected from retention forever, and the other ranks waited in the next
    collective. It now stops replication as a broken stream does: said in the status, the
    round decided (not copied), nothing left protected."""
    got = _two_ranks(_round_that_fails, str(tmp_path))
    for result in got:
        assert isinstance(result, tuple), result
        decided, took, broken, protected, copied = result
        assert decided and took < 30, result
        assert broken.startswith("ValueError: no folder for version 1"), broken
        assert 1 not in protected and not copied, result


def _ranks_out_of_step(rank, group, directory: str, released):
    """Rank 0 is told of version 2 only, rank 1 of version 1 only (published out of
    step): what each rank's round says, and how long ``wait`` took. Rank 0 stays (its
    group alive, as in a job that trains on) until rank 1's wait has ended."""
    import time

    from pcframe.distributed.global_versions import GlobalRecord, ShardRef
    from pcframe.distributed.replication import PeerReplication

    def shard_dir(version: int) -> Path:
        return Path(directory) / f"rank-{rank}" / f"v{version}"  # never read: no round runs

    store = PeerStore(Path(directory) / f"store-{rank}", budget=1 << 20)
    version = 2 - rank
    shards = tuple(ShardRef(r, f"rank-{r}", version, 1, f"{r:08x}", 1) for r in range(2))
    peers = PeerReplication(NodeMap(("a", "b")), rank, 1, store, shard_dir, group)
    peers.submit(GlobalRecord(version, version, 0.0, 2, shards))
    began = time.monotonic()
    decided = peers.wait(version, timeout=60)
    took = time.monotonic() - began
    if rank == 1:
        released.set()
    else:
        released.wait(timeout=90)
    peers.close()
    return decided, took, peers.status.broken


def test_ranks_told_of_different_versions_stop_replication_together(tmp_path):
    """A round copies the newest version every rank was told of. When a rank lacks it, every
    rank now sees that in the round's first exchange and stops at once, naming the rank;
    before, only the rank that lacked it raised, and the other waited in the round's next
    collective until the group's timeout (30 min by default)."""
    released = multiprocessing.get_context("spawn").Event()
    got = _two_ranks(_ranks_out_of_step, str(tmp_path), released)
    assert all(isinstance(result, tuple) for result in got), got
    # Both rounds ended at once (the old code left rank 1 in its wait for the full 60 s).
    assert [decided and took < 30 for decided, took, _ in got] == [True, True], got
    for _, _, broken in got:
        assert "version 1: not published on rank(s) [0]" in broken, broken


def _two_versions(directory: Path) -> Path:
    """Versions 1 and 2 (both whole) of a small model in ``directory``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 16)
    with Checkpointer(directory, model=model) as ckpt:
        ckpt.save(1).wait()
        with torch.no_grad():
            model.weight += 1.0
        ckpt.save(2).wait()
    return directory


def _rounds_with_a_store_broken_between(rank, group, roots: list[str], stores: str, released):
    """Two rounds; between them rank 1's store folder is replaced by a file (behind its
    back): how each rank's second round ended, and in how long. Rank 1 stays (its group
    alive, as in a job that trains on) until rank 0's wait has ended."""
    import shutil
    import time

    from pcframe.distributed.global_versions import GlobalRecord, ShardRef
    from pcframe.distributed.replication import PeerReplication
    from pcframe.format.names import version_name

    def shard_dir(version: int, r: int = rank) -> Path:
        return Path(roots[r]) / version_name(version)

    def record(version: int) -> GlobalRecord:
        shards = tuple(
            ShardRef(r, f"rank-{r}", version, version, _crc(shard_dir(version, r)), 1)
            for r in range(2)
        )
        return GlobalRecord(version, version, 0.0, 2, shards)

    store = PeerStore(Path(stores) / f"rank-{rank}", budget=1 << 24)
    peers = PeerReplication(NodeMap(("a", "b")), rank, 1, store, shard_dir, group)
    peers.submit(record(1))
    first = peers.wait(1, timeout=60) and peers.copied(1)
    if rank == 1:
        shutil.rmtree(store.directory)
        store.directory.write_text("not a folder any more")
    peers.submit(record(2))
    began = time.monotonic()
    decided = peers.wait(2, timeout=60)
    took = time.monotonic() - began
    if rank == 0:
        released.set()
    else:
        released.wait(timeout=90)
    peers.close()
    return first, decided, took, peers.copied(2), peers.status.broken, peers.status.declined


def test_a_store_broken_on_one_rank_costs_its_copies_not_the_other_ranks_rounds(tmp_path):
    """A rank whose store cannot be listed any more takes nothing in a round, in step with
    the others. Before, it stopped replicating alone (the error raised before the round's
    exchange of what each rank takes), and the other rank waited in that exchange until the
    group's timeout (30 min by default): its ``close()`` and any notice waited as long."""
    roots = [str(_two_versions(tmp_path / f"root-{r}")) for r in range(2)]
    released = multiprocessing.get_context("spawn").Event()
    stores = str(tmp_path / "stores")
    got = _two_ranks(_rounds_with_a_store_broken_between, roots, stores, released)
    assert all(isinstance(result, tuple) for result in got), got
    (
        (first0, decided0, took0, copied0, broken0, _),
        (first1, decided1, took1, copied1, broken1, declined1),
    ) = got
    assert first0 and first1  # the first round copied both ways
    assert decided0 and decided1 and max(took0, took1) < 30, got
    assert not copied0  # rank 0's shard had nowhere to go: not safe, and said so
    assert copied1  # rank 1 still sends its own shard to rank 0's store
    assert broken0 == broken1 == "" and declined1 >= 1, got


def test_the_default_peer_folder_is_the_users_own(tmp_path):
    """``/dev/shm`` is every user's: the copies live in a folder of this user's own, and one
    made there by someone else first (here: open to all, or a link to elsewhere) is refused
    by name, not written into (a planted copy could make a restore set a version aside)."""
    from pcframe.errors import TierError
    from pcframe.store.tiers.peer import default_peer_directory, private_folder

    where = default_peer_directory(tmp_path / "root", base=tmp_path)
    own = where.parent
    assert own.name == f"pcframe-peers-{os.getuid()}" and not own.exists()  # a path only
    assert private_folder(own) == own and (own.stat().st_mode & 0o777) == 0o700
    assert private_folder(own) == own  # again: it is this user's
    os.chmod(own, 0o777)
    with pytest.raises(TierError, match=r"pcframe-peers-\d+ is not this user's private folder"):
        private_folder(own)
    os.rmdir(own)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, own)
    with pytest.raises(TierError, match="remove it, or give peer_dir="):
        private_folder(own)


def test_a_stray_file_named_like_a_rank_folder_is_passed_over(tmp_path):
    """A file (or a link) where a ``rank-N`` folder would be holds no copy: the store lists
    around it, removes it when it opens (it raised ``NotADirectoryError`` from the
    constructor, and in a round stopped the replication), and never writes a copy through
    a link (such copies were neither listed nor pruned: memory without bound)."""
    sent = _save(tmp_path / "sender")
    store = PeerStore(tmp_path / "peers", budget=1 << 24)
    _copy_in(store, 0, 1, sent)
    (tmp_path / "peers" / "rank-7").write_text("junk")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "peers" / "rank-8")
    assert store.held() == {0: [1]}  # listed around them while running
    with pytest.raises(OSError, match="a link, not a folder of copies"):
        store.staging(8, 2)
    reopened = PeerStore(tmp_path / "peers", budget=1 << 24)
    assert reopened.held() == {0: [1]}
    assert sorted(reopened.swept) == ["rank-7", "rank-8"]
    assert not (tmp_path / "peers" / "rank-7").exists()
    assert not (tmp_path / "peers" / "rank-8").exists() and elsewhere.is_dir()
    assert reopened.make_room(copy_bytes(sent))


def _chain(directory: Path) -> Path:
    """Versions 1 (full) and 2 (a delta on 1) of one model in ``directory``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 64)
    engine = {"codecs": {"*": "xor_delta_zstd"}, "full_every": 4}
    with Checkpointer(directory, model=model, **engine) as ckpt:
        ckpt.save(1).wait()
        with torch.no_grad():
            model.weight[0, :8] += 1.0
        ckpt.save(2).wait()
    return directory


def _round_with_a_damaged_base(rank, group, roots: list[str], stores: str):
    from pcframe.distributed.global_versions import GlobalRecord, ShardRef
    from pcframe.distributed.replication import PeerReplication
    from pcframe.format.names import version_name

    def shard_dir(version: int, r: int = rank) -> Path:
        return Path(roots[r]) / version_name(version)

    store = PeerStore(Path(stores) / f"rank-{rank}", budget=1 << 24)
    shards = tuple(ShardRef(r, f"rank-{r}", 2, 2, _crc(shard_dir(2, r)), 1) for r in range(2))
    peers = PeerReplication(NodeMap(("a", "b")), rank, 1, store, shard_dir, group)
    peers.submit(GlobalRecord(2, 2, 0.0, 2, shards))
    peers.close()
    return store.held(), peers.copied(2), peers.status.failed, peers.secured


def test_a_delta_whose_base_was_refused_in_its_round_is_not_kept(tmp_path):
    """Rank 0's version 2 is a delta on its version 1, whose file is damaged: rank 1 refuses
    the base, and the delta that reads it arrives in the same round. It is received (the
    stream stays in step) but dropped, not counted as a copy: rank 0's shard is not safe on
    its peer, and the version is not secured (before, the delta was kept and counted, so a
    notice was told 'peers' for a copy that could not be read)."""
    damaged = _chain(tmp_path / "rank-0")
    _chain(tmp_path / "rank-1")  # the same chain, undamaged
    from pcframe.format.manifest import read_manifest

    assert read_manifest(str(damaged / "v00000002" / "manifest.json")).delta is not None
    flip_byte(damaged / "v00000001" / "codec.bin", 40)
    got = _two_ranks(
        _round_with_a_damaged_base,
        [str(tmp_path / "rank-0"), str(tmp_path / "rank-1")],
        str(tmp_path / "stores"),
    )
    (held0, copied0, _, secured0), (held1, copied1, failed1, secured1) = got
    assert held1 == {}, held1  # neither the damaged base nor the delta that reads it
    assert any("v1" in f and "checksum" in f for f in failed1), failed1
    assert any("v2" in f and "its base was refused" in f for f in failed1), failed1
    assert not copied0 and secured0 == secured1 == 0
    assert held0 == {1: [1, 2]} and copied1  # the other direction arrived whole


def test_a_long_jobs_peer_status_keeps_the_newest_lines_and_counts_them_all():
    """A job saving every few seconds for weeks, with a peer that refuses every copy: the
    status lists the newest lines only (it grew by one line per round, for ever), counts
    every one, and a waiter still sees every version up to the newest ended."""
    import threading

    from pcframe.distributed.replication import STATUS_KEPT, PeerReplication, PeerStatus

    peers = PeerReplication.__new__(PeerReplication)  # its bookkeeping only: no thread
    peers.status, peers._done = PeerStatus(), threading.Condition()
    peers._undecided, peers._decided_through = set(), 0
    rounds = 20 * STATUS_KEPT
    for version in range(1, rounds + 1):
        peers._undecided.add(version)
        peers._failed(f"rank 1 v{version}: refused")
        peers._finish([version], copied=version % 2 == 0)
    status = peers.status
    assert len(status.failed) == STATUS_KEPT and status.failures == rounds
    assert status.failed[-1] == f"rank 1 v{rounds}: refused"
    assert len(status.copied) == STATUS_KEPT and status.copied_count == rounds // 2
    assert peers.copied(rounds) and not peers.copied(rounds - 1)
    assert peers.wait(1, timeout=0) and peers.wait(rounds, timeout=0)
    assert not peers.wait(rounds + 1, timeout=0) and not peers._undecided
