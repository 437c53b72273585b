"""Shadows: a peer copy's replicated tensors written from the receiving rank's own state
(``pcframe/distributed/shadow.py``), so only the pieces they do not cover are streamed.

The multi-rank job (4 DDP ranks as 2 nodes, copies made of shadows, a node lost, the
restore bit-identical) is ``test_peer_recovery.py``'s first test, which also checks that
most of each copy came from its shadow.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from pcframe import Checkpointer
from pcframe.distributed.capture import ModelView, OptimizerView, Stash
from pcframe.distributed.shadow import _write, item_name, replicated_items, shadow_plan
from pcframe.format.manifest import read_manifest
from pcframe.format.pieces import file_sizes, pieces, verify_files
from pcframe.store.tiers.peer import SHADOW_MARK, PeerStore, Shadow, copy_bytes
from tests.distributed.test_peer_units import _two_ranks
from tests.helpers import flip_byte


def _shard(directory: Path, **engine) -> tuple[Path, dict[str, torch.Tensor]]:
    """A rank's shard as a DistributedCheckpointer writes one (the replicated items in the
    split's tree, through the engine's views) and ``{item name: tensor}`` of its items."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 80), torch.nn.Linear(80, 48))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 96)).sum().backward()
    optimizer.step()
    stash = Stash()
    items: dict[str, torch.Tensor] = {}
    stash.model = {}
    for key, tensor in model.state_dict().items():
        stash.model[key] = {"kind": "replicated", "data": tensor}
        items[f"model/{key}"] = tensor
    state = optimizer.state_dict()
    tree: dict[str, dict] = {}
    for index, per_param in state["state"].items():
        tree[str(index)] = {}
        for key, value in per_param.items():
            tree[str(index)][key] = {"kind": "replicated", "data": value}
            items[f"optimizer/{index}/{key}"] = value
    stash.optimizer = {"state": tree, "param_groups": state["param_groups"]}
    views = {"model": ModelView(model, stash), "optimizer": OptimizerView(optimizer, stash)}
    with Checkpointer(directory, **views, **engine) as ckpt:
        ckpt.save(1).wait()
    return directory / "v00000001", items


def test_entry_names_map_to_the_split_items_and_nothing_else():
    assert item_name("model/module.0.weight/data") == "model/module.0.weight"
    assert item_name("optimizer/state/3/exp_avg/data") == "optimizer/3/exp_avg"
    assert item_name("rng/torch") is None  # per rank: never shadowed
    assert item_name("stateful/data/seen/data") is None
    assert item_name("model/module.0.weight") is None


@pytest.mark.parametrize("stripes", [1, 3])
def test_a_shadow_writes_whole_chunks_as_the_sources_data_files_hold_them(tmp_path, stripes):
    """Every chunk holding only the split's tensors is written whole (the tensors' bytes,
    cut at chunk and stripe boundaries, and the zeros between them) and verifies against
    the source's checksums; a chunk holding anything else (the random number generators'
    states, per rank) is not written at all."""
    source, items = _shard(tmp_path / "src", chunk_bytes=4096, stripes=stripes)
    manifest = read_manifest(source / "manifest.json")
    places, chunks = shadow_plan(manifest, items)
    first_other = min(e.offset for e in manifest.entries if item_name(e.name) not in items)
    whole = {i for i, c in enumerate(manifest.chunks) if c.offset + c.length <= first_other}
    assert chunks == whole and len(chunks) > 2
    assert len(chunks) < len(manifest.chunks)  # the last holds the generators' states
    spare = tmp_path / "spare"
    spare.mkdir()
    for name, size in file_sizes(manifest).items():  # an older copy's bytes: not zeros
        (spare / name).write_bytes(b"\xa5" * size)
    assert _write(spare, places) == sum(manifest.chunks[i].length for i in chunks)
    covered = read_manifest(source / "manifest.json")
    covered.chunks = [c for i, c in enumerate(covered.chunks) if i in chunks]
    verify_files(spare, covered)
    untouched = [c for i, c in enumerate(manifest.chunks) if i not in chunks]
    for chunk in untouched:  # left as they were: the stream sends them
        place = _place_of(manifest, chunk)
        assert (spare / place[0]).read_bytes()[place[1] : place[1] + chunk.length] == (
            b"\xa5" * chunk.length
        )


def _place_of(manifest, chunk) -> tuple[str, int]:
    from pcframe.format.stripes import stripe_location, stripe_name

    stripe, offset = stripe_location(chunk.offset, manifest.chunk_bytes, manifest.stripes)
    return stripe_name(stripe), offset


def test_a_tensor_of_another_dtype_shape_or_layout_leaves_its_chunks_to_the_stream(tmp_path):
    source, items = _shard(tmp_path / "src", chunk_bytes=4096)
    manifest = read_manifest(source / "manifest.json")
    name = "model/0.weight"
    for other in (
        items[name].double(),  # dtype
        items[name][:10].clone(),  # shape
        items[name].t(),  # not contiguous
    ):
        others = {**items, name: other}
        _, chunks = shadow_plan(manifest, others)
        assert chunks < shadow_plan(manifest, items)[1], other.shape  # its chunks are not written


# --- the store's spare, filled ahead ------------------------------------------------------------


def test_the_store_makes_room_for_a_shadow_as_for_a_copy_and_marks_it(tmp_path):
    source, _ = _shard(tmp_path / "src", chunk_bytes=4096)
    size = copy_bytes(source)
    sizes = {"data.bin": (source / "data.bin").stat().st_size}
    store = PeerStore(tmp_path / "store", budget=2 * size)
    for version in (1, 2):  # two copies held: the budget is full
        staging = store.staging(0, version)
        shutil.copytree(source, staging)
        store.commit(0, version, staging)
    spare = store.prepare_shadow(sizes, size)
    assert spare == store.spare and (spare / "data.bin").stat().st_size == sizes["data.bin"]
    assert store.held() == {0: [2]}  # the oldest went, as for a copy received
    assert sorted(p.name for p in spare.iterdir()) == ["data.bin"]  # its manifest went too
    assert store.held_bytes() + store.spare_bytes() <= store.budget
    assert store.shadow_of(0, 3) is None  # not filled yet
    shadow = Shadow(frozenset(sizes), frozenset({0, 2}))
    store.mark_shadow(0, 3, shadow)
    assert store.shadow_of(0, 3) == shadow
    assert store.shadow_of(0, 4) is store.shadow_of(1, 3) is None
    assert store.prepare_shadow(sizes, size) == spare  # a new fill: the mark goes first
    assert store.shadow_of(0, 3) is None
    assert store.prepare_shadow(sizes, 3 * size) is None  # no room, whatever is dropped
    assert PeerStore(tmp_path / "store", budget=2 * size).shadow_of(0, 3) is None


def _copy(store: PeerStore, src: int, version: int, files: dict[str, int]) -> None:
    staging = store.staging(src, version)
    staging.mkdir(parents=True)
    for name, size in files.items():
        (staging / name).write_bytes(b"\1" * size)
    store.commit(src, version, staging)


def test_a_shadow_made_of_a_coded_copys_files_stays_within_the_budget(tmp_path):
    """The spare left by a copy of other files (a coded one: a small data.bin, a large
    codec.bin) holds only the shadow's files once it is prepared (a review found 513 bytes
    held against a budget of 373: the codec file stayed beside the grown data file)."""
    store = PeerStore(tmp_path / "store", budget=0)
    _copy(store, 1, 1, {"manifest.json": 1, "data.bin": 10, "codec.bin": 200})
    _copy(store, 1, 2, {"manifest.json": 1, "data.bin": 10})
    _copy(store, 0, 2, {"manifest.json": 1, "data.bin": 150})  # the layout
    store.budget = store.held_bytes()  # full
    assert store.prepare_shadow({"data.bin": 150}, copy_bytes(store.path(0, 2))) == store.spare
    assert sorted(p.name for p in store.spare.iterdir()) == ["data.bin"]
    assert store.held_bytes() + store.spare_bytes() <= store.budget


def test_a_copy_takes_a_spare_file_of_its_name_only_when_a_shadow_filled_it(tmp_path):
    from pcframe.distributed.shard_stream import _reserve, _spare_files

    spare = tmp_path / "spare"
    spare.mkdir()
    (spare / "data.bin").write_bytes(b"\1" * 10)
    (spare / "codec.bin").write_bytes(b"\2" * 200)
    into = tmp_path / "copy"
    into.mkdir()
    fd, reused = _reserve(into / "data.bin", 150, _spare_files(spare))
    os.close(fd)
    assert reused == "codec.bin"  # the largest: the room made is the largest file's
    (into / "data.bin").unlink()
    fd, reused = _reserve(into / "data.bin", 150, _spare_files(spare), same_name=True)
    os.close(fd)
    assert reused == "data.bin"


def test_a_shadow_holds_the_models_parameters_and_the_optimizers_state_not_its_buffers():
    from pcframe.distributed.placement import placement_of

    tensors = {
        "model/0.weight": torch.ones(2),
        "model/1.running_mean": torch.zeros(2),  # a buffer: differs between DDP ranks
        "optimizer/0/exp_avg": torch.ones(2),
        "model/2.weight": torch.ones(3),  # owned by another rank
    }
    placed = {name: placement_of(name, t) for name, t in tensors.items()}
    owners = {"model/0.weight": 1, "model/1.running_mean": 1, "optimizer/0/exp_avg": 1}
    owners["model/2.weight"] = 0
    items = replicated_items(placed, owners, [1], {"model/0.weight", "model/2.weight"})
    assert sorted(items[1]) == ["model/0.weight", "optimizer/0/exp_avg"]


# --- the stream, between two real ranks ---------------------------------------------------------


def _prefilled_stream(rank, group, sent: str, spare: str, into: str, chunks: list[int]):
    from pcframe.distributed.shard_stream import Streamed, receive_version, send_version

    if rank == 0:
        return send_version(Path(sent), 1, group)
    tally = Streamed()
    shadow = Shadow(frozenset({"data.bin"}), frozenset(chunks))
    manifest = receive_version(
        0, Path(into), group, spare=Path(spare), prefilled=shadow, tally=tally
    )
    return manifest.version, tally.sent, tally.prefilled, tally.missed


def _spare_of(source: Path, spare: Path) -> None:
    spare.mkdir()
    shutil.copy(source / "data.bin", spare / "data.bin")
    (spare / SHADOW_MARK).write_text("{}")  # a mark: never part of a copy


def test_only_the_chunks_a_shadow_wrote_and_got_right_are_not_streamed(tmp_path):
    """The spare holds the source's data file exactly, but the shadow says it wrote chunks
    0, 1 and 2 only, and chunk 2 is damaged (a tensor that differed on the receiving rank):
    chunks 0 and 1 are not streamed; chunk 2 and every chunk the shadow did not write are,
    though the bytes there match (an older copy's bytes are never compared: a 32-bit
    checksum is a check against damage, not a proof that other bytes are the same). The
    copy is the source's files byte for byte."""
    source, _ = _shard(tmp_path / "src", chunk_bytes=4096)
    manifest = read_manifest(source / "manifest.json")
    spare = tmp_path / "spare"
    _spare_of(source, spare)
    damaged = manifest.chunks[2]
    flip_byte(spare / "data.bin", damaged.offset + 7)
    into = tmp_path / "copy"
    sent, received = _two_ranks(_prefilled_stream, str(source), str(spare), str(into), [0, 1, 2])
    assert not isinstance(received, str), received
    kept = manifest.chunks[0].length + manifest.chunks[1].length
    assert received == (1, manifest.data_size - kept, kept, 1)  # one chunk missed
    assert sent == (source / "manifest.json").stat().st_size + manifest.data_size - kept
    for name in ("manifest.json", "data.bin"):
        assert filecmp.cmp(source / name, into / name, shallow=False), name
    assert not (spare / "data.bin").exists()  # taken for the copy's file of that name
    assert len(list(pieces(manifest))) == len(manifest.chunks) > 3
    assert os.path.exists(spare / SHADOW_MARK)  # never part of a copy


# --- the fill: on its own thread, before the optimizer's next step -------------------------------


def _fill_setup(tmp_path: Path):
    """A store holding a copy of rank 0's shard (the layout), the optimizer of the state it
    was made from, and ``{0: items}`` as the checkpointer hands them to the fill."""
    source, items = _shard(tmp_path / "src", chunk_bytes=4096)
    store = PeerStore(tmp_path / "store", budget=4 * copy_bytes(source))
    staging = store.staging(0, 1)
    shutil.copytree(source, staging)
    store.commit(0, 1, staging)
    weight = items["model/0.weight"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(weight)], lr=1.0)
    return store, optimizer, {0: items}, source


def test_the_optimizers_step_waits_for_the_fill_and_the_shadow_is_the_saved_state(
    tmp_path, monkeypatch
):
    from pcframe.distributed import shadow

    store, optimizer, items, source = _fill_setup(tmp_path)
    events: list[str] = []
    release = threading.Event()
    write = shadow._write

    def held_write(spare, places):
        events.append("fill begins")
        assert release.wait(60)
        done = write(spare, places)
        events.append("fill ends")
        return done

    monkeypatch.setattr(shadow, "_write", held_write)
    fill = shadow.ShadowFill(store, [0], optimizer)
    before = items[0]["model/0.weight"].clone()
    fill.start(2, items)
    optimizer.param_groups[0]["params"][0].grad = torch.ones_like(before)
    stepper = threading.Thread(target=lambda: (optimizer.step(), events.append("step")))
    stepper.start()
    stepper.join(0.5)  # held by the fill: the step cannot have run
    assert "step" not in events
    release.set()
    stepper.join(60)
    assert events == ["fill begins", "fill ends", "step"]
    assert store.shadow_of(0, 2) is not None
    entry = next(
        e
        for e in read_manifest(source / "manifest.json").entries
        if e.name.startswith("model/0.weight")
    )
    data = (store.spare / "data.bin").read_bytes()[entry.offset : entry.offset + entry.nbytes]
    assert data == before.numpy().tobytes()  # the weights before the step changed them
    assert not torch.equal(items[0]["model/0.weight"], before)
    assert fill.status.fills == 1 and fill.status.filled_bytes > 0
    fill.close()


def test_a_fill_that_fails_costs_only_its_shadow(tmp_path, monkeypatch):
    from pcframe.distributed import shadow

    store, optimizer, items, _ = _fill_setup(tmp_path)

    def broken_write(spare, places):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shadow, "_write", broken_write)
    fill = shadow.ShadowFill(store, [0], optimizer)
    fill.start(2, items)
    optimizer.step()  # does not raise: the copy will stream
    assert fill.status.skipped == 1 and fill.status.fills == 0
    assert store.shadow_of(0, 2) is None
    assert store.spare_lock.acquire(blocking=False)  # released
    store.spare_lock.release()
    fill.close()


def test_no_fill_while_a_round_holds_the_spare_or_for_a_rank_no_longer_wanted(tmp_path):
    from pcframe.distributed import shadow

    store, optimizer, items, _ = _fill_setup(tmp_path)
    unwanted: set[int] = set()
    fill = shadow.ShadowFill(store, [0], optimizer, wanted=lambda src: src not in unwanted)
    with store.spare_lock:  # a round in progress
        fill.start(2, items)
    fill.wait()
    assert fill.status.skipped == 1 and store.shadow_of(0, 2) is None
    unwanted.add(0)  # its shadow got a chunk wrong, or the replication stopped
    fill.start(3, items)
    fill.wait()
    assert fill.status.skipped == 2 and store.shadow_of(0, 3) is None
    unwanted.clear()
    fill.start(4, {0: {}})  # nothing of rank 0's is this rank's
    assert fill.status.skipped == 3
    fill.start(5, items)
    fill.wait()
    assert fill.status.fills == 1 and store.shadow_of(0, 5) is not None
    fill.close()
    fill.start(6, items)  # closed: no fill
    assert fill.status.skipped == 4


def test_a_store_that_cannot_be_listed_costs_the_shadow_not_the_save(tmp_path, monkeypatch):
    """``start()`` runs inside ``save()`` before its round is submitted: it raised the
    store's error there (a review's finding), leaving this rank's round unsubmitted."""
    import errno

    from pcframe.distributed import shadow

    store, optimizer, items, _ = _fill_setup(tmp_path)
    fill = shadow.ShadowFill(store, [0], optimizer)

    def held():
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(store, "held", held)
    fill.start(2, items)
    assert fill.status.skipped == 1
    fill.close()
