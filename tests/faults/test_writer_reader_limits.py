"""A version save() commits is one restore() reads: the writer refuses what the reader would.

The reader has hard limits against hostile manifests (nesting depth, dimensions, step range,
manifest size). Before, save() accepted state beyond them: the version committed, and the
next restore called it corrupt, quarantined it and fell back (every version, if the state
was always like that), so a restart began from step 0. Now save() raises at once, and the
versions before stay restorable.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pcframe.save.commit as commit
from pcframe import Checkpointer, SaveError
from pcframe.format.tree import MAX_DEPTH, TensorRef, check_tree, decode_tree, encode_tree


class Held:
    """A stateful section whose state the test sets."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


class WithBuffer(torch.nn.Module):
    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("b", buffer)


def nested(depth: int, leaf=1):
    value = leaf
    for i in range(depth):
        value = [value] if i % 3 == 0 else (value,) if i % 3 == 1 else {"k": value}
    return value


def test_state_nested_past_the_readers_limit_is_refused_by_save(tmp_path):
    held = Held({"fine": 1})
    with Checkpointer(tmp_path, stateful={"held": held}) as ckpt:
        ckpt.save(1).wait()
        held.state = {"deep": nested(MAX_DEPTH + 5)}
        with pytest.raises(TypeError, match="nested deeper than 64 levels"):
            ckpt.save(2)
        assert ckpt.committed_versions() == [1]
    held.state = None
    with Checkpointer(tmp_path, stateful={"held": held}) as ckpt:
        assert ckpt.restore() == 1  # (the step) nothing quarantined, nothing lost
    assert held.state == {"fine": 1}


def test_a_tensor_with_more_dimensions_than_a_reader_accepts_is_refused(tmp_path):
    model = WithBuffer(torch.zeros(2))
    with Checkpointer(tmp_path, model=model) as ckpt:
        ckpt.save(1).wait()
        model.b = torch.zeros([1] * 33)
        with pytest.raises(ValueError, match="at most 32 dimensions"):
            ckpt.save(2)
        assert ckpt.committed_versions() == [1]


@pytest.mark.parametrize("step", [2**62 + 1, -(2**62) - 1, 1.5, True, "3"])
def test_a_step_no_reader_accepts_is_refused(tmp_path, step):
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path, model=model) as ckpt:
        ckpt.save(1).wait()
        with pytest.raises(ValueError, match="step="):
            ckpt.save(step)
        assert ckpt.committed_versions() == [1]
        ckpt.save(2**62).wait()  # the limit itself is fine
    with Checkpointer(tmp_path, model=model) as ckpt:
        assert ckpt.restore() == 2**62  # restore() returns the step


def test_a_manifest_over_the_readers_size_limit_fails_its_version(tmp_path, monkeypatch):
    # The real limit is 256 MiB; the check is the same code at a size a test can afford.
    monkeypatch.setattr(commit, "MAX_MANIFEST_BYTES", 64 * 1024)
    held = Held({"log": "short"})
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), stateful={"held": held}) as ckpt:
        ckpt.save(1).wait()
        held.state = {"log": "x" * (128 * 1024)}
        with pytest.raises(SaveError, match="over the 65536 a pcframe reader accepts"):
            ckpt.save(2).wait()
        assert ckpt.committed_versions() == [1]
        held.state = {"log": "short again"}
        ckpt.save(3).wait()  # the next save commits
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), stateful={"held": held}) as ckpt:
        assert ckpt.restore() == 3


_leaf = st.one_of(st.integers(), st.text(max_size=3), st.none(), st.booleans())


def _wrap(inner):
    return st.one_of(
        st.lists(inner, max_size=2),
        st.tuples(inner),
        st.dictionaries(st.text("ab", max_size=2), inner, max_size=2),
        st.dictionaries(st.integers(0, 3), inner, max_size=2),  # a $dict node
    )


@settings(max_examples=60, deadline=None)
@given(st.integers(MAX_DEPTH - 4, MAX_DEPTH + 3), st.lists(st.integers(0, 3), max_size=80))
def test_whatever_the_encoder_accepts_the_reader_reads(depth, kinds):
    """Trees near the depth limit, of every container kind: encode raises, or the reader's
    own validator passes and the tree decodes back to what was saved."""
    value = 7
    for i in range(depth):
        kind = kinds[i % len(kinds)] if kinds else i % 4
        value = ([value], (value,), {"k": value}, {1: value})[kind]
    refs: list[TensorRef] = []
    try:
        encoded = encode_tree({"stateful": {"held": value}}, "", refs)
    except TypeError as exc:
        assert "nested deeper" in str(exc)
        return
    check_tree(encoded, 0)
    assert decode_tree(encoded, []) == {"stateful": {"held": value}}


def test_the_deepest_state_save_accepts_restores(tmp_path):
    depth = 0
    while True:  # the deepest the encoder takes for this section
        try:
            encode_tree({"stateful": {"held": nested(depth + 1)}}, "", [])
        except TypeError:
            break
        depth += 1
    held = Held(nested(depth))
    with Checkpointer(tmp_path, stateful={"held": held}) as ckpt:
        ckpt.save(1).wait()
    held.state = None
    with Checkpointer(tmp_path, stateful={"held": held}) as ckpt:
        assert ckpt.restore() == 1
    assert held.state == nested(depth)
