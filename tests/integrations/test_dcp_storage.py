"""pcframe as torch.distributed.checkpoint storage: real DCP, real gloo ranks, real files."""

from __future__ import annotations

import fractions
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import pcframe
from pcframe import Checkpointer
from pcframe.apps import cli
from pcframe.errors import CheckpointError, ConfigError, CorruptCheckpoint
from pcframe.format.manifest import DATA_NAME, MANIFEST_NAME, read_manifest
from pcframe.integrations.dcp import StorageReader, StorageWriter
from tests.integrations.dcp_ranks import (
    SHARDED,
    assert_loaded,
    fresh_state,
    run_ranks,
    sharded_value,
    trained,
    training_state,
)

# DCP warns on every call that no process group is initialized (one process is our intent).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _failure(exc: CheckpointException) -> BaseException:
    """The one rank's exception DCP wrapped (a single-process load has rank 0 only)."""
    (wrapped,) = exc.failures.values()
    return wrapped[0] if isinstance(wrapped, tuple) else wrapped


def _load(root: Path, step: int, **reader: object) -> None:
    net, opt, state = fresh_state()
    dcp.load(state, storage_reader=StorageReader(root, **reader))
    assert_loaded(net, opt, state, step)


def test_round_trip_one_rank_is_a_pcframe_version(tmp_path: Path, capsys) -> None:
    root = tmp_path / "ckpt"
    dcp.save(training_state(3), storage_writer=StorageWriter(root))
    _load(root, 3)

    # An ordinary pcframe version: the CLI lists, verifies, inspects and exports it.
    manifest = read_manifest(str(root / "v00000001" / MANIFEST_NAME))
    names = {e.name for e in manifest.entries}
    assert "model/0.weight" in names and "optim/state/0.weight/exp_avg" in names
    assert cli.main(["list", str(root)]) == 0
    assert cli.main(["verify", str(root)]) == 0
    assert "v1: OK" in capsys.readouterr().out
    assert cli.main(["inspect", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 1  # no step given: the version
    out = tmp_path / "model.safetensors"
    assert cli.main(["export", str(root), "--only", "model", "-o", str(out)]) == 0
    from safetensors.torch import load_file

    net, _ = trained(3)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in load_file(out).items())

    # Non-tensor items (param groups, the int step) are JSON in the manifest, not pickles.
    items = manifest.tree["dcp"]["items"]
    assert {i["kind"] for i in items} == {"tensor", "value"}


def test_keep_last_step_labels_and_chosen_versions(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for step in (1, 2, 3, 4):
        writer = StorageWriter(root, keep_last=2)
        dcp.save(training_state(step), checkpoint_id=root / f"step-{step}", storage_writer=writer)
        assert writer.last_version == step
    assert sorted(p.name for p in root.glob("v*")) == ["v00000003", "v00000004"]
    assert read_manifest(str(root / "v00000004" / MANIFEST_NAME)).step == 4  # from step-4
    _load(root, 4)
    _load(root, 3, version=3)
    # torchtitan-style: the checkpoint_id of the save picks its version.
    net, opt, state = fresh_state()
    dcp.load(state, checkpoint_id=root / "step-3", storage_reader=StorageReader(root))
    assert_loaded(net, opt, state, 3)
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            fresh_state()[2], checkpoint_id=root / "step-1", storage_reader=StorageReader(root)
        )
    assert "no committed version was saved with checkpoint_id" in str(_failure(info.value))


@pytest.mark.parametrize("stager", [True, False], ids=["DefaultStager", "internal-stager"])
def test_async_save(tmp_path: Path, stager: bool) -> None:
    root = tmp_path / "ckpt"
    if stager:
        default = DefaultStager(StagingOptions(False, False, True, False))
        response = dcp.async_save(
            training_state(2), storage_writer=StorageWriter(root), async_stager=default
        )
        response.upload_completion.result()
        default.close()
    else:
        dcp.async_save(training_state(2), storage_writer=StorageWriter(root)).result()
    _load(root, 2)


def test_corrupt_data_file_is_one_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    dcp.save(training_state(1), storage_writer=StorageWriter(root))
    data = root / "v00000001" / DATA_NAME
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as info:
        dcp.load(fresh_state()[2], storage_reader=StorageReader(root))
    error = _failure(info.value)
    assert isinstance(error, CorruptCheckpoint)
    assert "\n" not in str(error) and str(data) in str(error)
    assert "checksum mismatch" in str(error) and "version=N" in str(error)
    assert cli.main(["verify", str(root)]) == 1


def test_the_read_holds_the_cyclic_collector_off_and_gives_it_back(tmp_path: Path) -> None:
    """As pcframe's own restores: no full collection lands among the read's objects while
    the planner places them, and the collector is on again once dcp.load returns."""
    import gc

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    seen: list[bool] = []

    class Probe(DefaultLoadPlanner):
        def commit_tensor(self, read_item, tensor) -> None:
            seen.append(gc.isenabled())
            super().commit_tensor(read_item, tensor)

    root = tmp_path / "ckpt"
    dcp.save(training_state(2), storage_writer=StorageWriter(root))
    net, opt, state = fresh_state()
    assert gc.isenabled()
    dcp.load(state, storage_reader=StorageReader(root), planner=Probe())
    assert seen and not any(seen)  # paused for every tensor placed
    assert gc.isenabled()
    assert_loaded(net, opt, state, 2)


def test_damaged_manifest_falls_back_to_the_previous_version(tmp_path: Path, caplog) -> None:
    root = tmp_path / "ckpt"
    for step in (1, 2):
        dcp.save(training_state(step), storage_writer=StorageWriter(root, step=step))
    (root / "v00000002" / MANIFEST_NAME).write_text("garbage")
    _load(root, 1)
    assert "skipping checkpoint version 2" in caplog.text
    with pytest.raises(CheckpointException):  # asked for by number: no silent fallback
        dcp.load(fresh_state()[2], storage_reader=StorageReader(root, version=2))


def test_pickled_values_are_refused_unless_allowed(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    state = {"w": torch.ones(3), "odd": fractions.Fraction(1, 3), "plain": {"a": (1, 2.5)}}
    dcp.save(state, storage_writer=StorageWriter(root))
    target = {"w": torch.zeros(3), "odd": None, "plain": {"a": None}}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=StorageReader(root))
    message = str(_failure(info.value))
    assert "'odd' was stored as pickled bytes" in message and "allow_pickle=True" in message
    dcp.load(target, storage_reader=StorageReader(root, allow_pickle=True))
    assert target["odd"] == fractions.Fraction(1, 3) and target["plain"] == {"a": (1, 2.5)}
    assert torch.equal(target["w"], torch.ones(3))


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ({"allow_pickle": "no"}, r"StorageReader\(allow_pickle='no'\): give True or False"),
        ({"allow_pickle": 1}, r"StorageReader\(allow_pickle=1\): give True or False"),
        ({"threads": 0}, r"StorageReader\(threads=0\): give 1\.\.256 reader threads"),
        ({"threads": "8"}, r"StorageReader\(threads='8'\): give 1\.\.256 reader threads"),
    ],
)
def test_a_reader_argument_of_the_wrong_kind_is_refused_when_made(
    tmp_path: Path, argument: dict[str, object], message: str
) -> None:
    """allow_pickle="no" (a string from a config file) is truthy: it unpickled the values a
    checkpoint stored pickled, which runs whatever code the file names."""
    root = tmp_path / "ckpt"
    dcp.save(
        {"w": torch.ones(3), "odd": fractions.Fraction(1, 3)}, storage_writer=StorageWriter(root)
    )
    with pytest.raises(TypeError, match=message):
        StorageReader(root, **argument)


def test_bad_setup_is_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(2)}, storage_writer=StorageWriter())
    assert "StorageWriter has no directory" in str(_failure(info.value))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.ones(2)}, storage_reader=StorageReader(tmp_path / "none"))
    assert "no committed pcframe version" in str(_failure(info.value))
    with pytest.raises(TypeError, match="unknown engine option"):
        StorageWriter(tmp_path, writer_thread=3)
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    for root in (afile, afile / "below"):  # a raw NotADirectoryError naming root/global
        with pytest.raises(CheckpointException) as info:
            dcp.save({"w": torch.ones(2)}, storage_writer=StorageWriter(root))
        assert f"{afile} is a file, not a folder" in str(_failure(info.value))


@pytest.mark.parametrize("strict", [True, False])
def test_a_dcp_version_given_to_checkpointer_restore_names_the_dcp_reader(
    tmp_path: Path, strict: bool
) -> None:
    """Checkpointer.restore() / pcframe.load() of a version dcp.save wrote: the mismatch
    said the checkpoint held no model state and advised strict=False, which then returned
    the version's step having loaded nothing (a job resuming at that step from fresh
    weights). Refused in one line naming the DCP reader; nothing is loaded or renamed."""
    root = tmp_path / "ckpt"
    dcp.save(training_state(3), storage_writer=StorageWriter(root))
    net, opt, _ = fresh_state()
    before = [t.clone() for t in net.state_dict().values()]
    message = r"v00000001.*written by torch DCP.*StorageReader"
    with pytest.raises(CheckpointError, match=message):
        pcframe.load(root, model=net, optimizer=opt, strict=strict)
    with Checkpointer(root, model=net, optimizer=opt) as ckpt:
        with pytest.raises(CheckpointError, match=message):
            ckpt.restore(strict=strict)
        assert ckpt.committed_versions() == [1]
    assert all(torch.equal(a, b) for a, b in zip(before, net.state_dict().values(), strict=True))
    _load(root, 3)  # the DCP reader still loads it


def test_a_step_no_reader_takes_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A step outside ±2**62 or not an integer (from ``step=`` or the id's trailing number)
    committed a version every restore refused, after ``keep_last`` had pruned the good one
    before it (the engine's own ``save()`` refuses such a step; the writer skipped it)."""
    root = tmp_path / "ckpt"
    dcp.save(training_state(1), storage_writer=StorageWriter(root, keep_last=1, step=100))
    for bad in (True, "5", 1.5, 2**63):
        with pytest.raises(ConfigError, match=r"StorageWriter\(step=.*±2\*\*62"):
            StorageWriter(root, keep_last=1, step=bad)
    with pytest.raises(CheckpointException) as info:
        dcp.save(
            training_state(2),
            checkpoint_id=root / "step-99999999999999999999",
            storage_writer=StorageWriter(root, keep_last=1),
        )
    assert "its step 99999999999999999999 is beyond ±2**62" in str(_failure(info.value))
    assert sorted(p.name for p in root.glob("v*")) == ["v00000001"]  # the good one stays
    _load(root, 1)


@pytest.mark.slow
def test_two_gloo_ranks_then_reshard_to_one(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_ranks(2, "two_ranks", root)
    assert [rc for rc, _ in results] == [0, 0], "\n".join(out[-3000:] for _, out in results)
    # Global versions 3 and 4 (keep_last=2); each rank's shard is a pcframe version.
    records = sorted(p.name for p in (root / "global").iterdir())
    assert records == ["v00000003.json", "v00000004.json"]
    for rank in (0, 1):
        assert cli.main(["verify", str(root / f"rank-{rank}")]) == 0
    # 2 -> 1: one process loads the whole DTensor, both ranks' tensors, model and optimizer.
    net, opt, state = fresh_state()
    state.update(sharded=torch.zeros(SHARDED), rank0=torch.zeros(3), rank1=torch.zeros(3))
    dcp.load(state, storage_reader=StorageReader(root))
    assert_loaded(net, opt, state, 4)
    assert torch.equal(state["sharded"], sharded_value(4))
    assert torch.equal(state["rank1"], torch.full((3,), 14.0))
    net, opt, state = fresh_state()
    state["sharded"] = torch.zeros(SHARDED)
    dcp.load(state, storage_reader=StorageReader(root, version=3))
    assert_loaded(net, opt, state, 3)
    # A one-rank save continues the same root as a one-rank global version.
    dcp.save({"sharded": sharded_value(5)}, storage_writer=StorageWriter(root, keep_last=2))
    assert (root / "global" / "v00000005.json").exists()
    loaded = {"sharded": torch.zeros(SHARDED)}
    dcp.load(loaded, storage_reader=StorageReader(root))
    assert torch.equal(loaded["sharded"], sharded_value(5))


@pytest.mark.slow
def test_example_runs(tmp_path: Path, child_env: dict[str, str], python: str) -> None:
    import subprocess

    example = Path(__file__).resolve().parents[2] / "examples" / "integrations" / "dcp_example.py"
    done = subprocess.run(
        [python, str(example), str(tmp_path / "ckpt")],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed at step 20" in done.stdout


def test_writer_pickles_for_process_async_and_ids_validate(tmp_path: Path) -> None:
    import pickle

    # AsyncCheckpointerType.PROCESS sends the writer to another process: plain attributes.
    writer = StorageWriter(tmp_path, keep_last=2, writer_threads=2)
    clone = pickle.loads(pickle.dumps(writer))
    assert clone.root == writer.root and clone.config.writer_threads == 2
    assert StorageReader.validate_checkpoint_id(tmp_path) is False  # nothing committed yet
    dcp.save({"w": torch.ones(2)}, storage_writer=writer)
    assert StorageReader.validate_checkpoint_id(tmp_path) is True
    assert StorageWriter.validate_checkpoint_id(tmp_path / "new") is True


def test_a_save_overlapping_another_in_this_process_is_refused(tmp_path: Path) -> None:
    from pcframe.store.directory import WritableCheckpointDir

    root = tmp_path / "ckpt"
    dcp.save(training_state(1), storage_writer=StorageWriter(root))
    busy = WritableCheckpointDir(root)  # what a still-running async_save holds
    try:
        with pytest.raises(CheckpointException) as info:
            dcp.save(training_state(2), storage_writer=StorageWriter(root))
    finally:
        busy.close()
    assert "still running in this process" in str(_failure(info.value))
    _load(root, 1)  # the committed version is untouched
    dcp.save(training_state(2), storage_writer=StorageWriter(root))
    _load(root, 2)


def test_a_value_the_tree_would_store_as_its_base_type_stays_pickled_without_a_warning(caplog):
    """A namedtuple made in a function (no reader could find its class) is pickled by DCP,
    type and all: the tree's warning that it is stored as a plain tuple was false there."""
    import logging
    from collections import namedtuple

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    from pcframe.integrations.dcp.schema import plain_value

    point = namedtuple("Point", "x y")
    planner = DefaultSavePlanner()
    planner.set_up_planner({"extra": {"point": point(1, 2), "plain": [1, 2]}}, None, True)
    items = {
        item.index.fqn: item
        for item in planner.create_local_plan().items
        if item.type == WriteItemType.BYTE_IO
    }
    with caplog.at_level(logging.WARNING, logger="pcframe"):
        assert plain_value(planner, items["extra.point"]) == (False, None)
        assert plain_value(planner, items["extra.plain"])[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
