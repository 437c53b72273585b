"""The pickle-free state tree: whatever a state_dict holds comes back as the same types."""

from __future__ import annotations

import json
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
