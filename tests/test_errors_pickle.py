"""pcframe's exceptions cross process boundaries whole (a process pool's worker, a spawned
trial, a launcher reporting a child's failure): pickled and loaded, each is the same error."""

from __future__ import annotations

import pickle

import pytest

from pcframe.errors import CorruptCheckpoint, SaveError, StateMismatch, TornSnapshot
from pcframe.integrations._common import CallbackSaveError


def _same(error: BaseException) -> BaseException:
    loaded = pickle.loads(pickle.dumps(error))
    assert type(loaded) is type(error)
    assert str(loaded) == str(error)
    return loaded


def test_a_save_error_pickles_with_its_fields():
    cause = OSError(28, "No space left on device")
    error = SaveError(7, 120, "write", cause, committed_before=False)
    loaded = _same(error)
    assert (loaded.version, loaded.step, loaded.stage) == (7, 120, "write")
    assert loaded.committed_before is False
    assert isinstance(loaded.cause, OSError) and loaded.cause.errno == 28


def test_a_wrapped_save_error_keeps_its_own_wording():
    inner = SaveError(3, 9, "round", CorruptCheckpoint("rank 1: shard damaged"))
    loaded = _same(SaveError(3, 9, "round", inner))
    assert loaded.committed_before == inner.committed_before


def test_a_state_mismatch_pickles_with_every_mismatch():
    error = StateMismatch("model: 2 problems", ["model: missing key w", "model: b is float64"])
    assert _same(error).mismatches == error.mismatches


def test_a_torn_snapshot_pickles_with_its_names():
    loaded = _same(TornSnapshot(4, ["model.w", "model.b"]))
    assert loaded.names == ["model.w", "model.b"] and loaded.version == 4


@pytest.mark.parametrize("committed", [True, False])
def test_a_callbacks_save_error_pickles_as_its_own_class(committed):
    cause = OSError(5, "Input/output error")
    error = CallbackSaveError("stopped the fit: version 2 failed", 2, 8, "sync", cause, committed)
    loaded = _same(error)
    assert (loaded.version, loaded.step, loaded.stage, loaded.committed_before) == (
        2, 8, "sync", committed,
    )  # fmt: skip


class _LibraryError(Exception):
    """A third-party library's exception whose __init__ takes two arguments: it does not
    unpickle from its args."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


@pytest.mark.parametrize("callback", [False, True])
def test_a_save_error_whose_cause_does_not_pickle_pickles_with_the_cause_named(callback):
    cause = _LibraryError(503, "slow down")
    if callback:
        error = CallbackSaveError("stopped the fit", 4, 12, "upload", cause, False)
    else:
        error = SaveError(4, 12, "upload", cause)
    loaded = _same(error)
    assert (loaded.version, loaded.step, loaded.stage) == (4, 12, "upload")
    assert str(loaded.cause) == "_LibraryError: 503: slow down"
