"""Shadows: a peer copy's replicated tensors written from the receiving rank's own state
(``pcframe/distributed/shadow.py``), so only the pieces they do not cover are streamed.

The multi-rank job (4 DDP ranks as 2 nodes, copies made of shadows, a node lost, the
restore bit-identical) is ``test_peer_recovery.py``'s first test, which also checks that
most of each copy came from its shadow.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from pcframe import Checkpointer
from pcframe.distributed.capture import ModelView, OptimizerView, Stash
from pcframe.distributed.shadow import _places, _write, item_name
from pcframe.format.manifest import read_manifest
from pcframe.format.pieces import file_sizes, pieces, verify_files
from pcframe.store.tiers.peer import SHADOW_MARK, PeerStore, copy_bytes
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
def test_a_shadow_lays_the_items_out_as_the_sources_data_files(tmp_path, stripes):
    """Every tensor byte of the shard lands where the source's files hold it, cut at chunk
    and stripe boundaries (small chunks: most tensors straddle several), and every chunk
    holding only shadowed tensors verifies against the source's checksums."""
    source, items = _shard(tmp_path / "src", chunk_bytes=4096, stripes=stripes)
    manifest = read_manifest(source / "manifest.json")
    places = list(_places(manifest, items))
    shadowed = [e for e in manifest.entries if item_name(e.name) in items]
    assert sum(p.length for p in places) == sum(e.nbytes for e in shadowed) > 0
    assert len(places) > len(shadowed)  # cut at boundaries
    spare = tmp_path / "spare"
    spare.mkdir()
    for name, size in file_sizes(manifest).items():
        with open(spare / name, "wb") as handle:
            handle.truncate(size)
    assert _write(spare, places) == sum(p.length for p in places)
    for place in places:
        expected = (source / place.file).read_bytes()[place.offset : place.offset + place.length]
        got = (spare / place.file).read_bytes()[place.offset : place.offset + place.length]
        assert got == expected, place
    # Every chunk before the first entry of another section (the random number generators'
    # states, which differ per rank) holds only shadowed tensors and padding: it checks.
    first_other = min(e.offset for e in manifest.entries if item_name(e.name) not in items)
    covered = read_manifest(source / "manifest.json")
    covered.chunks = [c for c in covered.chunks if c.offset + c.length <= first_other]
    assert len(covered.chunks) > 2
    verify_files(spare, covered)


def test_a_tensor_of_another_dtype_shape_or_device_layout_is_left_to_the_stream(tmp_path):
    source, items = _shard(tmp_path / "src", chunk_bytes=4096)
    manifest = read_manifest(source / "manifest.json")
    name = "model/0.weight"
    for other in (
        items[name].double(),  # dtype
        items[name][:10].clone(),  # shape
        items[name].t(),  # not contiguous
    ):
        places = list(_places(manifest, {name: other}))
        assert places == [], other.shape
    assert list(_places(manifest, {name: items[name]}))


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
    assert store.shadow_files(0, 3) == frozenset()  # not filled yet
    store.mark_shadow(0, 3, sizes)
    assert store.shadow_files(0, 3) == {"data.bin"}
    assert store.shadow_files(0, 4) == store.shadow_files(1, 3) == frozenset()
    assert store.prepare_shadow(sizes, size) == spare  # a new fill: the mark goes first
    assert store.shadow_files(0, 3) == frozenset()
    assert store.prepare_shadow(sizes, 3 * size) is None  # no room, whatever is dropped
    assert PeerStore(tmp_path / "store", budget=2 * size).shadow_files(0, 3) == frozenset()


# --- the stream, between two real ranks ---------------------------------------------------------


def _prefilled_stream(rank, group, sent: str, spare: str, into: str):
    from pcframe.distributed.shard_stream import Streamed, receive_version, send_version

    if rank == 0:
        return send_version(Path(sent), 1, group)
    tally = Streamed()
    manifest = receive_version(
        0, Path(into), group, spare=Path(spare), prefilled={"data.bin"}, tally=tally
    )
    return manifest.version, tally.sent, tally.prefilled


def test_only_the_pieces_a_shadow_got_wrong_are_streamed_and_the_copy_is_exact(tmp_path):
    """The spare holds the source's data file with one chunk damaged (a tensor that differed
    on the receiving rank): that chunk is streamed, the others are not, and the copy is the
    source's files byte for byte."""
    source, _ = _shard(tmp_path / "src", chunk_bytes=4096)
    manifest = read_manifest(source / "manifest.json")
    spare = tmp_path / "spare"
    spare.mkdir()
    shutil.copy(source / "data.bin", spare / "data.bin")
    (spare / SHADOW_MARK).write_text(json.dumps({"src": 0, "version": 1, "files": ["data.bin"]}))
    damaged = manifest.chunks[2]
    flip_byte(spare / "data.bin", damaged.offset + 7)
    into = tmp_path / "copy"
    sent, received = _two_ranks(_prefilled_stream, str(source), str(spare), str(into))
    assert not isinstance(received, str), received
    assert received == (1, damaged.length, manifest.data_size - damaged.length)
    manifest_bytes = (source / "manifest.json").stat().st_size
    assert sent == manifest_bytes + damaged.length
    for name in ("manifest.json", "data.bin"):
        assert filecmp.cmp(source / name, into / name, shallow=False), name
    assert not (spare / "data.bin").exists()  # taken for the copy's file of that name
    listed = list(pieces(manifest))
    assert len(listed) == len(manifest.chunks) > 3
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
    assert store.shadow_files(0, 2) == {"data.bin"}
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
    assert store.shadow_files(0, 2) == frozenset()
    assert store.spare_lock.acquire(blocking=False)  # released
    store.spare_lock.release()
    fill.close()


def test_no_fill_while_a_round_holds_the_spare_or_the_replication_stopped(tmp_path):
    from pcframe.distributed import shadow

    store, optimizer, items, _ = _fill_setup(tmp_path)
    running = [True]
    fill = shadow.ShadowFill(store, [0], optimizer, active=lambda: running[0])
    with store.spare_lock:  # a round in progress
        fill.start(2, items)
    fill.wait()
    assert fill.status.skipped == 1 and store.shadow_files(0, 2) == frozenset()
    running[0] = False
    fill.start(3, items)
    fill.wait()
    assert fill.status.skipped == 2 and store.shadow_files(0, 3) == frozenset()
    running[0] = True
    fill.start(4, {0: {}})  # nothing of rank 0's is this rank's
    assert fill.status.skipped == 3
    fill.start(5, items)
    fill.wait()
    assert fill.status.fills == 1 and store.shadow_files(0, 5) == {"data.bin"}
    fill.close()
    fill.start(6, items)  # closed: no fill
    assert fill.status.skipped == 4
