"""State values of a standard subtype come back as that type: a ``Counter`` (MultiStepLR's
milestones), ``OrderedDict``, ``defaultdict``, namedtuple or enum member came back as a
plain dict, tuple, int or str before, silently."""

from __future__ import annotations

import enum
import json
import sys
import types
from collections import Counter, OrderedDict, defaultdict, namedtuple
from typing import NamedTuple

import pytest
import torch

import pcframe.format.manifest as manifest_module
from pcframe import Checkpointer
from pcframe.errors import UnsupportedCheckpoint
from tests.helpers import StateBox, small_training, train_steps

Point = namedtuple("Point", "x y")


class Run(NamedTuple):
    name: str
    losses: list


class Phase(enum.IntEnum):
    WARMUP = 1
    TRAIN = 2


class Access(enum.IntFlag):
    READ = 4
    WRITE = 2


class Split(enum.StrEnum):
    TRAIN = "train"
    VALID = "valid"


class Mode(enum.Enum):
    FAST = "fast"
    HALF = 0.5


def same(a, b) -> bool:
    """Equal values of exactly the same types, all the way down (a defaultdict's factory too)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, defaultdict) and a.default_factory is not b.default_factory:
        return False
    if isinstance(a, dict):  # the keys' types and order too
        return same(list(a), list(b)) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def typed_state() -> dict:
    return {
        "counter": Counter({30: 1, 80: 2, "zero": 0, "minus": -1}),
        "ordered": OrderedDict([("b", 1), ("a", [2])]),
        "lists": defaultdict(list, {"k": [1, 2]}),
        "counts": defaultdict(int, {3: 4}),
        "nested_factory": defaultdict(Counter, {"x": Counter("aab")}),
        "no_factory": defaultdict(None, {"y": 1}),
        "point": Point(1, torch.arange(3)),
        "run": Run("a", [Counter(z=3), Point(Phase.TRAIN, None)]),  # nested both ways
        "phase": Phase.WARMUP,
        "access": Access.READ | Access.WRITE,
        "split": Split.VALID,
        "modes": [Mode.FAST, Mode.HALF],
        "by_enum": {Split.TRAIN: 1, Phase.TRAIN: 2, Point(1, 2): 3},
        "plain": {"t": (1, 2), 1: "int key", "l": [1.5, None]},
    }


def header(root, version: int = 1) -> dict:
    return json.loads((root / f"v{version:08d}" / "manifest.json").read_bytes().split(b"\n")[0])


def test_stateful_values_of_standard_subtypes_come_back_with_their_types(tmp_path):
    saved = typed_state()
    with Checkpointer(tmp_path, stateful={"h": StateBox(typed_state())}) as ckpt:
        ckpt.save(step=1).wait()
    back = StateBox({})
    with Checkpointer(tmp_path, stateful={"h": back}) as ckpt:
        assert ckpt.restore() == 1
    for key, value in saved.items():
        assert same(back.state[key], value), key
    back.state["lists"]["new"].append(1)  # the factory works
    assert back.state["counts"][9] == 0 and back.state["counter"].most_common(1) == [(80, 2)]
    assert header(tmp_path)["format_version"] == 5  # an older reader says "upgrade"


def test_extra_keeps_standard_subtypes(tmp_path):
    def make() -> dict:
        return {
            "seen": Counter({"cat": 2, "dog": 1}),
            "order": OrderedDict([("z", 1), ("a", 2)]),
            "by_epoch": defaultdict(list, {"0": [0.5]}),
            "phase": Phase.TRAIN,
            "split": Split.TRAIN,
            "best": Point(3, [Counter(a=1)]),  # a namedtuple, not refused as a tuple
        }

    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), extra=make()) as ckpt:
        ckpt.save(step=1).wait()
    extra: dict = {}
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), extra=extra) as ckpt:
        assert ckpt.restore() == 1
    for key, value in make().items():
        assert same(extra[key], value), key


def test_multistep_lr_milestones_stay_a_counter(tmp_path):
    model, optimizer, _ = small_training()
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 4, 4], gamma=0.5)
    train_steps(model, optimizer, scheduler, 3)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        ckpt.save(step=3).wait()
    train_steps(model, optimizer, scheduler, 3)

    model2, optimizer2, _ = small_training(seed=5)
    scheduler2 = torch.optim.lr_scheduler.MultiStepLR(optimizer2, milestones=[9], gamma=0.1)
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2, scheduler=scheduler2) as c:
        assert c.restore() == 3
    assert type(scheduler2.milestones) is Counter
    assert sorted(scheduler2.milestones.elements()) == [2, 4, 4]  # a Counter method
    train_steps(model2, optimizer2, scheduler2, 3)
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()  # the schedule went on as saved


@pytest.mark.parametrize("section", ["stateful", "extra"])
def test_a_type_no_reader_could_rebuild_is_stored_as_its_base_type_with_a_warning(
    tmp_path, section, caplog
):
    """A lambda or a class of the user's as a defaultdict's factory (a restore would call
    it: only built-in types are named), a namedtuple or an IntEnum made inside a function
    (no reader finds them by name): stored as the plain dict, tuple or int they were stored
    as before, with a warning naming the place, never refused (common code saved them)."""
    local_pair = namedtuple("LocalPair", "a b")
    local_level = enum.IntEnum("LocalLevel", "LOW HIGH")

    class Bucket(list):
        pass

    value = {
        "counts": defaultdict(lambda: 0, {"a": 1}),
        "buckets": defaultdict(Bucket, {"b": Bucket([2])}),
        "pair": local_pair(1, 2),
        "level": local_level.HIGH,
    }
    given = {"stateful": {"h": StateBox(value)}} if section == "stateful" else {"extra": value}
    where = "/stateful/h" if section == "stateful" else "/extra"
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), **given) as ckpt:
        ckpt.save(step=1).wait()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for key in ("counts", "buckets", "pair", "level"):
        assert any(f"'{where}/{key}'" in line for line in warned), (key, warned)
    box = StateBox({})
    again = {"stateful": {"h": box}} if section == "stateful" else {"extra": {}}
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), **again) as ckpt:
        assert ckpt.restore() == 1
        back = box.state if section == "stateful" else ckpt.extra
    assert type(back["counts"]) is dict and back["counts"] == {"a": 1}
    assert type(back["buckets"]) is dict and back["buckets"] == {"b": [2]}
    assert type(back["pair"]) is tuple and back["pair"] == (1, 2)
    assert type(back["level"]) is int and back["level"] == 2


def test_a_module_given_as_a_stateful_object_keeps_the_version_in_format_1(tmp_path):
    """An EMA model in stateful= (its state_dict an OrderedDict by torch's habit) made every
    version format 5, which the release before cannot read."""
    ema = torch.nn.BatchNorm1d(3)
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), stateful={"ema": ema}) as ckpt:
        ckpt.save(step=1).wait()
    header = json.loads((tmp_path / "v00000001" / "manifest.json").read_bytes().split(b"\n")[0])
    assert header["format_version"] == 1


def gone_module(monkeypatch) -> types.ModuleType:
    """A module of classes that the restoring process will not have imported."""
    module = types.ModuleType("pcframe_test_gone")
    module.Pair = namedtuple("Pair", "a b", module=module.__name__)
    module.Level = enum.IntEnum("Level", "LOW HIGH", module=module.__name__)

    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda m: m.Pair(1, 2), "namedtuple class pcframe_test_gone.Pair"),
        (lambda m: [m.Level.HIGH], "enum class pcframe_test_gone.Level"),
    ],
    ids=["namedtuple", "enum"],
)
def test_a_class_missing_at_restore_stops_it_naming_the_class_and_path(
    tmp_path, monkeypatch, make, what
):
    module = gone_module(monkeypatch)
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path, model=model, stateful={"h": StateBox({"v": make(module)})}) as c:
        c.save(step=1).wait()
    monkeypatch.delitem(sys.modules, module.__name__)

    live = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    box = StateBox({"v": "as it was"})
    with (
        Checkpointer(tmp_path, model=live, stateful={"h": box}) as ckpt,
        pytest.raises(UnsupportedCheckpoint) as raised,
    ):
        ckpt.restore()
    message = str(raised.value)
    assert "'/stateful/h/v" in message and what in message, message
    assert "import pcframe_test_gone before the restore" in message and "\n" not in message
    # Nothing changed, nothing renamed: the version is not damaged, this process lacks a class.
    assert box.state == {"v": "as it was"}
    assert all(torch.equal(live.state_dict()[k], v) for k, v in before.items())
    assert (tmp_path / "v00000001").is_dir()
    assert not [p.name for p in tmp_path.iterdir() if "corrupt" in p.name]
    monkeypatch.setitem(sys.modules, module.__name__, module)  # imported again: it restores
    with Checkpointer(tmp_path, model=live, stateful={"h": box}) as ckpt:
        assert ckpt.restore() == 1
    assert same(box.state["v"], make(module))


def test_a_reader_before_the_subtypes_calls_such_a_version_newer_not_corrupt(tmp_path, monkeypatch):
    with Checkpointer(tmp_path, stateful={"h": StateBox({"c": Counter(a=1)})}) as ckpt:
        ckpt.save(step=1).wait()
    monkeypatch.setattr(manifest_module, "READABLE_VERSIONS", (1, 2, 3, 4))
    with (
        Checkpointer(tmp_path, stateful={"h": StateBox({})}) as ckpt,
        pytest.raises(UnsupportedCheckpoint, match=r"format_version 5 .*upgrade"),
    ):
        ckpt.restore()
    assert (tmp_path / "v00000001").is_dir()  # nothing renamed


def test_state_of_base_types_is_written_as_before(tmp_path):
    """What a model, an optimizer, a StepLR and JSON extra save stays format 1, readable by
    every pcframe: a module's OrderedDict state and the tree's own section keys (a StrEnum)
    are not stored as subtypes; dicts, tuples and ints come back as they are."""
    model, optimizer, scheduler = small_training()
    train_steps(model, optimizer, scheduler, 2)
    state = {"by_id": {1: (2, 3)}, "n": 4, "s": "x"}
    with Checkpointer(
        tmp_path,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        stateful={"h": StateBox(dict(state))},
        extra={"best": 0.5},
    ) as ckpt:
        ckpt.save(step=2).wait()
    assert header(tmp_path)["format_version"] == 1
    back = StateBox({})
    with Checkpointer(tmp_path, stateful={"h": back}) as ckpt:
        assert ckpt.restore() == 2
    assert same(back.state, state)
