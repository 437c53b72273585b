"""Single-process checks of the pieces: ownership, boxes, global records, retention, reading."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pcframe import Checkpointer
from pcframe.distributed import DistributedCheckpointer
from pcframe.distributed import global_versions as rec
from pcframe.distributed.global_versions import retention_allowed
from pcframe.distributed.index import ShardSource
from pcframe.distributed.partition import assign_owners
from pcframe.distributed.placement import Box, shard_box
from pcframe.distributed.restore import assemble
from pcframe.errors import CheckpointError, CorruptCheckpoint, ManifestError
from pcframe.format.manifest import DATA_NAME, MANIFEST_NAME, read_manifest
from pcframe.restore.reader import read_entries

# --- ownership of replicated tensors -------------------------------------------------------


def test_every_tensor_has_exactly_one_owner_and_bytes_are_balanced():
    rng = random.Random(0)
    sizes = [(f"t{i}", rng.randrange(1, 1 << 20)) for i in range(200)]
    owners = assign_owners(sizes, 4)
    assert set(owners) == {name for name, _ in sizes}
    loads = [0] * 4
    for name, size in sizes:
        loads[owners[name]] += size
    # Largest-first greedy: no rank is ahead of another by more than the largest tensor.
    assert max(loads) - min(loads) <= max(size for _, size in sizes)
    assert max(loads) <= 1.05 * sum(loads) / 4


def test_owners_do_not_depend_on_the_order_ranks_list_their_tensors():
    sizes = [(f"layer{i}.weight", 4096 * (i % 5 + 1)) for i in range(30)] + [("a", 4096)]
    shuffled = list(sizes)
    random.Random(1).shuffle(shuffled)
    assert assign_owners(sizes, 3) == assign_owners(shuffled, 3)


def test_base_loads_steer_replicated_state_to_ranks_with_fewer_shard_bytes():
    owners = assign_owners([("x", 10), ("y", 10)], 2, base_loads=[100, 0])
    assert owners == {"x": 1, "y": 1}


@pytest.mark.parametrize(
    ("sizes", "world", "base", "message"),
    [
        ([("a", 1)], 0, None, "world_size"),
        ([("a", -1)], 2, None, "negative"),
        ([("a", 1), ("a", 2)], 2, None, "twice"),
        ([("a", 1)], 2, [0], "base_loads"),
    ],
)
def test_assign_owners_rejects_bad_input(sizes, world, base, message):
    with pytest.raises(ValueError, match=message):
        assign_owners(sizes, world, base)


# --- boxes of sharded tensors --------------------------------------------------------------


def test_shard_boxes_match_torch_dtensor_chunking():
    from torch.distributed.tensor import Shard

    for size, parts in itertools.product(range(12), range(1, 5)):
        for index in range(parts):
            expected = Shard.local_shard_size_and_offset(size, parts, index)
            box = shard_box((size, 3), (parts,), (index,), (Shard(0),))
            assert (box.shape[0], box.offset[0]) == tuple(expected), (size, parts, index)


@pytest.mark.parametrize(
    "placements",
    [("S0", "S0"), ("S0", "S1"), ("R", "S1"), ("S1", "R")],
)
def test_shard_boxes_tile_the_tensor_on_a_2d_mesh(placements):
    from torch.distributed.tensor import Replicate, Shard

    real = tuple(Replicate() if p == "R" else Shard(int(p[1])) for p in placements)
    shape, mesh = (7, 5), (2, 3)
    covered = torch.zeros(shape, dtype=torch.int32)
    for coordinate in itertools.product(range(2), range(3)):
        box = shard_box(shape, mesh, coordinate, real)
        writer = all(c == 0 for c, p in zip(coordinate, placements, strict=True) if p == "R")
        if writer:
            covered[box.slices_within(Box.full(shape))] += 1
    assert torch.equal(covered, torch.ones(shape, dtype=torch.int32))


def test_assemble_reshards_a_2d_layout_into_a_different_1d_layout():
    from torch.distributed.tensor import Shard

    full = torch.arange(9 * 6, dtype=torch.float64).reshape(9, 6)
    whole = Box.full(full.shape)
    sources, loaded = [], {}
    for rank, coordinate in enumerate(itertools.product(range(2), range(2))):
        box = shard_box(tuple(full.shape), (2, 2), coordinate, (Shard(0), Shard(1)))
        sources.append(ShardSource(rank, 0, box))
        loaded[rank] = {0: full[box.slices_within(whole)].clone()}
    for index in range(4):  # 9 rows on 4 ranks: 3, 3, 3 and an empty box
        target = shard_box(tuple(full.shape), (4,), (index,), (Shard(0),))
        found = [(s, cut) for s in sources if (cut := s.box.intersect(target)) is not None]
        assert sum(cut.numel for _, cut in found) == target.numel
        got = assemble(target, found, loaded, full.dtype)
        assert torch.equal(got, full[target.slices_within(whole)])


def test_box_intersection():
    a, b = Box((0, 0), (4, 4)), Box((2, 3), (4, 4))
    assert a.intersect(b) == Box((2, 3), (2, 1))
    assert a.intersect(Box((4, 0), (1, 4))) is None
    assert Box((), ()).intersect(Box((), ())) == Box((), ())  # scalars always overlap


# --- global records --------------------------------------------------------------------------


def record(version: int = 3, world: int = 2) -> rec.GlobalRecord:
    shards = tuple(
        rec.ShardRef(r, rec.rank_dirname(r), version, 30, f"{r:08x}", 100 + r) for r in range(world)
    )
    return rec.GlobalRecord(version, 30, 1.5, world, shards)


def test_a_fifo_named_global_is_ignored_not_waited_on(tmp_path):
    rec.write_record(tmp_path, record(3))
    os.mkfifo(tmp_path / rec.POINTER)  # a hostile or broken root: nobody will ever write it
    listing = subprocess.run(
        [sys.executable, "-m", "pcframe.apps.cli", "list", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,  # the old read_text() blocked here for ever
    )
    assert "Traceback" not in listing.stderr and "3" in listing.stdout, listing
    assert rec.read_pointer(tmp_path) is None  # a hint only: the records still list v3


def _cli(*args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pcframe.apps.cli", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_the_cli_names_a_roots_record_folder_and_a_shard_kept_on_another_node(tmp_path):
    """A root per node (the peer tier's layout) holds only its own ranks' shards: ``verify``
    there said "No such file or directory" for every other rank's shard, as if the version
    were damaged. ``list ROOT/global`` listed nothing with exit code 0, and a ``global``
    that is a file was a raw ``[Errno 20]``. Each is now one line that says what to do."""
    written = tmp_path / "rank-0"
    torch.manual_seed(0)
    with Checkpointer(written, model=torch.nn.Linear(8, 4)) as ckpt:
        ckpt.save(1).wait()
    crc = rec.manifest_crc(written / "v00000001" / MANIFEST_NAME)
    shards = (
        rec.ShardRef(0, "rank-0", 1, 1, crc, 100),
        rec.ShardRef(1, "rank-1", 1, 1, "0badc0de", 100),  # on another node's root
    )
    rec.write_record(tmp_path, rec.GlobalRecord(1, 1, 0.0, 2, shards))
    rec.write_pointer(tmp_path, 1)
    verify = _cli("verify", tmp_path)
    assert verify.returncode == 1 and "Traceback" not in verify.stderr
    assert "rank 1: no rank-1 folder in this root (a root per node" in verify.stdout
    assert "rank 0" not in verify.stdout  # the shard that is here verifies
    inner = _cli("list", tmp_path / rec.RECORDS)
    assert inner.returncode == 2 and f"give its parent, the root: {tmp_path}" in inner.stderr
    for path in (tmp_path / rec.RECORDS).iterdir():
        path.unlink()
    (tmp_path / rec.RECORDS).rmdir()
    (tmp_path / rec.RECORDS).write_text("not a folder")
    listing = _cli("list", tmp_path)
    assert (
        listing.returncode == 2 and "not a folder" in listing.stderr and "move it" in listing.stderr
    )
    assert len(listing.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("unchecked", [(0, 1), (0,)], ids=["every rank", "rank 0"])
def test_verify_says_a_global_version_without_checksums_was_checked_for_structure_only(
    tmp_path, capsys, unchecked
):
    """A multi-rank version whose shards were saved with checksum="none" has no checksums for
    their data: verify said "OK" (even with a data byte changed), as if it had checked them;
    a single-process version was already said to be checked for structure only."""
    from pcframe.apps import cli

    shards = []
    for rank in (0, 1):
        written = tmp_path / rec.rank_dirname(rank)
        checksum = "none" if rank in unchecked else "crc32c"
        with Checkpointer(written, model=torch.nn.Linear(8, 4), checksum=checksum) as ckpt:
            ckpt.save(1).wait()
        crc = rec.manifest_crc(written / "v00000001" / MANIFEST_NAME)
        shards.append(rec.ShardRef(rank, written.name, 1, 1, crc, 100))
    rec.write_record(tmp_path, rec.GlobalRecord(1, 1, 0.0, 2, tuple(shards)))
    data = tmp_path / rec.rank_dirname(0) / "v00000001" / DATA_NAME
    raw = bytearray(data.read_bytes())
    raw[3] ^= 1  # not seen: no checksum to compare with
    data.write_bytes(bytes(raw))
    assert cli.main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    who = "saved" if unchecked == (0, 1) else "rank(s) 0 saved"
    assert out == (
        f"v1: structure OK, data not verified (2 ranks, 8 tensors, 200 bytes; {who} with "
        "checksum none)\n"
    )


def test_record_round_trip_and_pointer(tmp_path):
    rec.write_record(tmp_path, record(3))
    rec.write_pointer(tmp_path, 3)
    assert rec.read_record(rec.record_path(tmp_path, 3)) == record(3)
    assert rec.read_pointer(tmp_path) == 3
    assert rec.record_versions(tmp_path) == [3]


def test_altered_record_is_rejected_naming_the_file_and_the_fix(tmp_path):
    rec.write_record(tmp_path, record(3))
    path = rec.record_path(tmp_path, 3)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match=r"v00000003\.json.*delete this file"):
        rec.read_record(path)


def write_raw_record(root: Path, version: int, body: dict, format_version: int = 1) -> Path:
    import crc32c

    raw = json.dumps(body).encode()
    header = {
        "format": rec.FORMAT,
        "format_version": format_version,
        "body_bytes": len(raw),
        "body_crc32c": f"{crc32c.crc32c(raw):08x}",
    }
    path = rec.record_path(root, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(json.dumps(header).encode() + b"\n" + raw)
    return path


def good_body() -> dict:
    return json.loads(record(3).to_bytes().split(b"\n", 1)[1])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b["shards"][1].update(directory="../../etc"), "directory"),
        (lambda b: b["shards"].reverse(), "rank order"),
        (lambda b: b["shards"].pop(), "one shard per rank"),
        (lambda b: b["shards"][0].update(manifest_crc32c="zz"), "manifest_crc32c"),
        (lambda b: [x.update(version=4) for x in [b, *b["shards"]]], "file name says version 3"),
        # a mix of two saves (each shard's manifest crc genuine): refused, not restored
        (lambda b: b["shards"][1].update(version=2), "shard 1 is version 2 at step 30, not"),
        (lambda b: b.update(step=12345), "not the record's version 3 at step 12345"),
        (lambda b: b.update(world_size=True), "world_size"),
    ],
)
def test_hostile_record_bodies_are_refused(tmp_path, change, message):
    body = good_body()
    change(body)
    path = write_raw_record(tmp_path, 3, body)
    with pytest.raises(ManifestError, match=message):
        rec.read_record(path)


def test_newer_record_format_asks_for_an_upgrade(tmp_path):
    path = write_raw_record(tmp_path, 3, good_body(), format_version=2)
    with pytest.raises(ManifestError, match="upgrade pcframe"):
        rec.read_record(path)


def test_valid_records_lists_newest_first_and_reports_bad_ones(tmp_path):
    for version in (1, 2, 3):
        rec.write_record(tmp_path, record(version))
    rec.record_path(tmp_path, 3).write_bytes(b"garbage")
    (tmp_path / rec.RECORDS / "v00000004.json.tmp").write_bytes(b"half")
    good, bad = rec.valid_records(tmp_path)
    assert [r.version for r in good] == [2, 1]
    assert [v for v, _ in bad] == [3]
    rec.remove_partial_records(tmp_path)
    assert not (tmp_path / rec.RECORDS / "v00000004.json.tmp").exists()


# --- retention ---------------------------------------------------------------------------------


def test_retention_keeps_current_and_previous_global_and_undecided_versions():
    # Globals 4 and 6 retained; rounds decided up to 7; 8 and 9 still in flight.
    assert retention_allowed([1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 6], 7) == [1, 2, 3, 5, 7]
    # Before anything is decided, nothing goes (it might still become global).
    assert retention_allowed([1, 2], [], 0) == []


# --- selective reading -----------------------------------------------------------------------


def written_version(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = {
        "a": torch.arange(3000, dtype=torch.float32),
        "b": torch.arange(5000, dtype=torch.int64),
        "c": torch.tensor(7.0),
    }

    class Holder:
        def state_dict(self):
            return state

        def load_state_dict(self, value):
            pass

    with Checkpointer(root, stateful={"s": Holder()}, chunk_bytes=4096) as ckpt:
        ckpt.save(1).wait()
    return root / "v00000001", state


def entry_index(manifest, suffix: str) -> int:
    return next(i for i, e in enumerate(manifest.entries) if e.name.endswith(suffix))


def test_read_entries_reads_only_what_is_asked_and_verifies_it(tmp_path):
    directory, state = written_version(tmp_path)
    manifest = read_manifest(str(directory / MANIFEST_NAME))
    a, b = entry_index(manifest, "/a"), entry_index(manifest, "/b")
    got = read_entries(directory, manifest, [a], threads=2)
    assert set(got) == {a}
    assert torch.equal(got[a], state["a"])
    # Damage a chunk that holds only tensor b: reading a still works, reading b fails.
    entry = manifest.entries[b]
    inner = manifest.layout.chunks[(entry.offset + entry.nbytes // 2) // 4096]
    assert all(p.entry == b for p in inner.pieces)
    with open(directory / DATA_NAME, "r+b") as f:
        f.seek(inner.offset + 10)
        byte = f.read(1)
        f.seek(inner.offset + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert torch.equal(read_entries(directory, manifest, [a])[a], state["a"])
    with pytest.raises(CorruptCheckpoint, match=rf"{DATA_NAME}: checksum mismatch in chunk"):
        read_entries(directory, manifest, [b])


def test_read_entries_refuses_a_truncated_data_file(tmp_path):
    directory, _ = written_version(tmp_path)
    manifest = read_manifest(str(directory / MANIFEST_NAME))
    with open(directory / DATA_NAME, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        read_entries(directory, manifest, [0])


# --- API guards --------------------------------------------------------------------------------


def test_needs_an_initialised_process_group(tmp_path):
    with pytest.raises(CheckpointError, match="init_process_group"):
        DistributedCheckpointer(tmp_path)


def test_keeps_at_least_two_global_versions(tmp_path):
    with pytest.raises(ValueError, match="keep_global=1"):
        DistributedCheckpointer(tmp_path, keep_global=1)


def test_stored_boxes_that_overlap_but_add_up_are_refused_not_half_loaded():
    """Two stored boxes of a [4, 2] tensor that overlap on row 1 and together count 8
    elements: by volume they 'cover' it, yet row 3 is in neither. The multi-rank restore
    refuses such a version as damaged (it left row 3 unloaded before)."""
    from types import SimpleNamespace

    from pcframe.distributed.index import SavedItem, ShardSource
    from pcframe.distributed.placement import Box, Placed
    from pcframe.distributed.restore import _pieces
    from pcframe.errors import ManifestError

    def index_with(*boxes: Box) -> SimpleNamespace:
        item = SavedItem("model/w", "float32", (4, 2), True)
        item.sources = [ShardSource(rank, 0, box) for rank, box in enumerate(boxes)]
        return SimpleNamespace(
            record=SimpleNamespace(version=3), world_size=2, items={"model/w": item}
        )

    whole = Box((0, 0), (4, 2))
    placed = Placed(torch.zeros(4, 2), (4, 2), whole)
    overlapping = index_with(Box((0, 0), (2, 2)), Box((1, 0), (2, 2)))  # rows 0-1, 1-2
    with pytest.raises(ManifestError, match=r"global version 3: .*'model/w'.*overlaps"):
        _pieces("model/w", placed, whole, overlapping, 0, 2)
    exact = index_with(Box((0, 0), (2, 2)), Box((2, 0), (2, 2)))
    assert len(_pieces("model/w", placed, whole, exact, 0, 2)) == 2


def test_a_set_aside_records_reason_is_written_through_nothing_planted(tmp_path):
    """The reason (``.corrupt-vN-<pid>.why``) was written with write_text(): through a link
    planted under the name a file outside the root was overwritten."""
    outside = tmp_path / "victim"
    outside.write_text("the user's")
    root = tmp_path / "root"
    rec.write_record(root, record(3))
    why = root / rec.RECORDS / f".corrupt-v00000003-{os.getpid()}.why"
    why.symlink_to(outside)
    rec.quarantine_record(root, 3, "damaged: checksum")
    assert outside.read_text() == "the user's"
    assert why.read_text() == "damaged: checksum\n" and not why.is_symlink()


def test_a_stray_file_named_like_a_version_takes_its_number_in_a_multi_rank_root(tmp_path):
    """The DCP writer and the commit protocol number from the root and its rank folders: a
    file named v00000003 in a rank's folder made the publish of version 3 fail there with
    a raw NotADirectoryError."""
    rec.write_record(tmp_path, record(2))
    (tmp_path / "rank-1").mkdir()
    (tmp_path / "rank-1" / "v00000003").write_text("not a version")
    assert rec.next_version(tmp_path) == 4


def test_a_records_folder_that_is_a_link_is_neither_written_nor_read_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / rec.RECORDS).symlink_to(outside)
    with pytest.raises(CheckpointError, match="global is a link"):
        rec.write_record(root, record(3))
    with pytest.raises(CheckpointError, match="global is a link"):
        rec.valid_records(root)
    assert list(outside.iterdir()) == []


LINKED_RANK = """
import sys, torch
import torch.distributed as dist
from pcframe.distributed import DistributedCheckpointer
from pcframe.errors import CheckpointError

root, rendezvous = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=0, world_size=1)
try:
    DistributedCheckpointer(root, model=torch.nn.Linear(2, 2))
    print("opened")
except CheckpointError as exc:
    print(exc)
dist.destroy_process_group()
"""


def test_a_rank_folder_that_is_a_link_is_refused_when_the_job_opens(tmp_path):
    """Restores refuse to read a shard through a link, so the save must not write one."""
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / "rank-0").symlink_to(elsewhere)
    done = subprocess.run(
        [sys.executable, "-c", LINKED_RANK, str(root), str(tmp_path / "rdv")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"{root / 'rank-0'} is a link" in done.stdout, done.stdout + done.stderr
    assert list(elsewhere.iterdir()) == []


RESTORE_THREADS = """
import sys, torch
import torch.distributed as dist
from pcframe.distributed import DistributedCheckpointer

root, rendezvous = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=0, world_size=1)
with DistributedCheckpointer(root, model=torch.nn.Linear(2, 2)) as ckpt:
    for threads in ("8", 0, 10**6, 2.5, True):
        try:
            print(repr(ckpt.restore(threads=threads)))
        except TypeError as exc:
            print(exc)
    print(repr(ckpt.restore(threads=2)))  # nothing saved yet: None
dist.destroy_process_group()
"""


def test_a_distributed_restore_refuses_reader_threads_as_load_does(tmp_path):
    """``restore(threads=...)`` was not checked: ``"8"`` or ``10**6`` went on to the readers
    (and with nothing saved yet, returned None as if fine). Refused now as ``load()`` refuses
    them, in one line naming the argument and the range."""
    done = subprocess.run(
        [sys.executable, "-c", RESTORE_THREADS, str(tmp_path / "ckpt"), str(tmp_path / "rdv")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stdout.splitlines()
    assert lines == [
        f"restore(threads={bad}): give 1..256 reader threads, e.g. 8"
        for bad in ("'8'", "0", "1000000", "2.5", "True")
    ] + ["None"], done.stdout + done.stderr
