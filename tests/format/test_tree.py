"""The pickle-free state tree: whatever a state_dict holds comes back as the same types."""

from __future__ import annotations

import enum
import json
import random
import sys
from collections import Counter, OrderedDict, defaultdict, namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pcframe.errors import ManifestError, UnsupportedCheckpoint
from pcframe.format.tree import TensorRef, check_tree, decode_tree, encode_tree

plain = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=5)
scalars = plain | st.floats(allow_nan=False)
trees = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.lists(plain, max_size=700).map(tuple)  # long flat tuples (an RNG state) included
        | st.dictionaries(st.text(max_size=4).filter(lambda k: not k.startswith("$")), inner)
        | st.dictionaries(st.integers(0, 9), inner, max_size=3)
    ),
    max_leaves=30,
)


def round_trip(value):
    refs: list[TensorRef] = []
    encoded = json.loads(json.dumps(encode_tree(value, "state", refs)))  # as the manifest
    check_tree(encoded, len(refs))
    return decode_tree(encoded, [r.tensor for r in refs])


def same(a, b) -> bool:
    """Equal values of exactly the same types, all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=150, deadline=None)
@given(trees)
def test_every_tree_comes_back_with_its_types(value):
    assert same(round_trip(value), value)


def test_python_rng_state_and_tensors_in_flat_sequences():
    state = random.Random(3).getstate()  # (3, a tuple of 625 ints, None)
    tensor = torch.arange(4)
    value = {"rng": state, "mixed": [1, tensor, "x"], "ints": [1, 2, True, None]}
    back = round_trip(value)
    assert same(back["rng"], state)
    restored = random.Random()
    restored.setstate(back["rng"])
    assert restored.random() == random.Random(3).random()
    assert torch.equal(back["mixed"][1], tensor) and back["mixed"][0::2] == [1, "x"]
    assert same(back["ints"], value["ints"])


Pair = namedtuple("Pair", "a b")


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


subtyped = st.recursive(
    scalars | st.sampled_from(Level),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.builds(Pair, inner, inner)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3).map(Counter)
        | st.dictionaries(st.integers(0, 9), inner, max_size=3).map(OrderedDict)
        | st.dictionaries(st.sampled_from(Level), inner, max_size=2).map(
            lambda d: defaultdict(list, d)
        )
    ),
    max_leaves=20,
)


def same_factory(a, b) -> bool:
    """``same``, and every defaultdict's factory is the same."""
    if isinstance(a, defaultdict) and a.default_factory is not b.default_factory:
        return False
    if isinstance(a, dict):
        return all(same_factory(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return all(same_factory(x, y) for x, y in zip(a, b, strict=True))
    return True


@settings(max_examples=100, deadline=None)
@given(subtyped)
def test_standard_subtypes_come_back_as_themselves(value):
    back = round_trip({"v": value})["v"]
    assert same(back, value) and same_factory(back, value)


class Shouting(enum.StrEnum):
    """A common recipe: its _missing_ upper-cases what it is given (a file's 7 made it raise
    a raw AttributeError; a restore never calls it now)."""

    LOUD = "LOUD"

    @classmethod
    def _missing_(cls, value):
        return cls.__members__.get(value.upper())


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({"$enum": ["os", "system", "true"]}, r"names os.system as its enum class.*function"),
        ({"$defaultdict": [["os", "getcwd"], {}]}, r"names os.getcwd as its default_factory class"),
        ({"$namedtuple": ["builtins", "tuple", []]}, r"tuple as its namedtuple class, .* type"),
        ({"$enum": ["this", "Thing", 1]}, r"enum class this.Thing is not defined in this"),
        # A class's constructor with an effect, called at the next missing key: only
        # built-in types are a factory.
        (
            {"$defaultdict": [["tempfile", "TemporaryDirectory"], {}]},
            r"names tempfile.TemporaryDirectory as its default_factory class",
        ),
        # Enum's own bases have no members: calling them raised a raw TypeError.
        ({"$enum": ["enum", "IntFlag", 3]}, r"names enum.IntFlag as its enum class"),
        (
            {"$enum": [__name__, "Shouting", 7]},
            r"7 is not a value of the enum tests.format.test_tree.Shouting",
        ),
    ],
    ids=[
        "function-as-enum",
        "function-as-factory",
        "tuple-as-namedtuple",
        "not-imported",
        "class-as-factory",
        "memberless-enum",
        "value-the-enum-lacks",
    ],
)
def test_a_class_named_by_a_file_is_looked_up_never_imported_or_called(node, message):
    """A hostile manifest may name any module and attribute: no module is imported, and
    nothing that is not a class of the tag's kind is used (a defaultdict would call it)."""
    imported = "this" in sys.modules
    check_tree({"x": [node]}, 0)  # well-formed: the lookup is the restore's
    with pytest.raises(UnsupportedCheckpoint, match=message) as raised:
        decode_tree({"x": [node]}, [], path="/stateful")
    assert "at '/stateful/x/0'" in str(raised.value)
    assert ("this" in sys.modules) == imported
    assert decode_tree({"x": [node]}, [], classes=False) is not None  # a verify needs no class


@pytest.mark.parametrize(
    "node",
    [
        {"$enum": ["os", "<locals>.X", 1]},
        {"$enum": ["os", "X", [1]]},
        {"$namedtuple": ["m", "P", "items"]},
        {"$counter": [1, 2]},
        {"$odict": {"$t": 0}},
        {"$defaultdict": [["builtins", "list"]]},
        {"$defaultdict": ["builtins.list", {}]},
    ],
)
def test_malformed_subtype_nodes_are_refused_by_the_check(node):
    with pytest.raises(ManifestError, match="malformed"):
        check_tree({"x": node}, 1)
