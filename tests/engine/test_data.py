"""The data position helper resumes with exactly the next unseen sample."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pcframe import ResumableLoader, ResumableSampler


def make(seed=3):
    dataset = TensorDataset(torch.arange(50))
    loader = DataLoader(dataset, batch_size=4, sampler=ResumableSampler(50, seed=seed))
    return ResumableLoader(loader)


def drain(loader, batches):
    out = []
    while len(out) < batches:
        for (batch,) in loader:
            out.append(batch.tolist())
            if len(out) == batches:
                break
    return out


def test_resume_mid_epoch_and_across_epochs():
    straight = drain(make(), 40)  # 13 batches per epoch: crosses three epoch boundaries
    for cut in (1, 7, 13, 14, 30):
        first = make()
        head = drain(first, cut)
        state = first.state_dict()
        second = make()
        second.load_state_dict(state)
        assert head + drain(second, 40 - cut) == straight, f"cut at batch {cut}"


def test_epochs_are_distinct_permutations():
    loader = make()
    epochs = [[i for batch in drain(loader, 13) for i in batch] for _ in range(2)]
    assert sorted(epochs[0]) == list(range(50)) == sorted(epochs[1])
    assert epochs[0] != epochs[1]


def test_wrong_seed_is_refused():
    loader = make(seed=3)
    other = make(seed=4)
    with pytest.raises(ValueError, match="seed 3"):
        other.load_state_dict(loader.state_dict())


def test_needs_resumable_sampler():
    with pytest.raises(TypeError, match="ResumableSampler"):
        ResumableLoader(DataLoader(TensorDataset(torch.arange(4))))
