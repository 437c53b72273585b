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


class Sentences(torch.utils.data.Dataset):
    """Variable-length token sequences with their text: what an NLP loader hands out."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, index: int) -> dict:
        return {"text": f"sentence {index}", "tokens": torch.full((1 + index % 5,), index)}


def _sequence_first(samples: list[dict]) -> dict:
    # pad_sequence's default layout is [time, batch]: the first tensor's length is not the
    # batch size, and the first value is a list of strings.
    tokens = torch.nn.utils.rnn.pad_sequence([s["tokens"] for s in samples])
    return {"text": [s["text"] for s in samples], "tokens": tokens}


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_sequence_first_batch_of_text_resumes_at_the_next_unseen_samples(drop_last):
    """Before, the position counted the first tensor's length (time steps, here 5 per batch
    of 4) or raised "cannot tell the batch size of a str" on the text."""

    def make_text() -> ResumableLoader:
        sampler = ResumableSampler(30, seed=5)
        return ResumableLoader(
            DataLoader(Sentences(), batch_size=4, sampler=sampler, collate_fn=_sequence_first,
                       drop_last=drop_last)
        )  # fmt: skip

    def texts(loader: ResumableLoader, batches: int) -> list[list[str]]:
        out: list[list[str]] = []
        while len(out) < batches:
            for batch in loader:
                out.append(batch["text"])
                if len(out) == batches:
                    break
        return out

    straight = texts(make_text(), 20)  # 7 (or 8) batches per epoch: crosses two epochs
    for cut in (2, 7, 9):
        first = make_text()
        head = texts(first, cut)
        second = make_text()
        second.load_state_dict(first.state_dict())
        assert head + texts(second, 20 - cut) == straight, f"cut at batch {cut}"


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


def sized(samples: int, shuffle: bool = True) -> ResumableLoader:
    dataset = TensorDataset(torch.arange(samples))
    sampler = ResumableSampler(samples, seed=3, shuffle=shuffle)
    return ResumableLoader(DataLoader(dataset, batch_size=4, sampler=sampler))


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (lambda: sized(40), "of 50 samples an epoch, shuffle=True; this sampler has 40,"),
        (lambda: sized(50, shuffle=False), "shuffle=True; this sampler has 50, shuffle=False"),
    ],
)
def test_a_mid_epoch_position_into_other_data_is_refused(other, message):
    """The rest of an epoch is the rest of a permutation of the saved dataset: into another
    size (or order) it silently trained some samples of that epoch twice and never others."""
    loader = make()
    drain(loader, 3)
    with pytest.raises(ValueError, match=message):
        other().load_state_dict(loader.state_dict())


def test_a_position_at_an_epoch_boundary_goes_into_other_data():
    loader = make()
    drain(loader, 13)  # the whole first epoch: the next one starts afresh
    grown = sized(60)
    grown.load_state_dict(loader.state_dict())
    assert sorted(i for batch in drain(grown, 15) for i in batch) == list(range(60))


def test_needs_resumable_sampler():
    with pytest.raises(TypeError, match="ResumableSampler"):
        ResumableLoader(DataLoader(TensorDataset(torch.arange(4))))


class Augmented(torch.utils.data.Dataset):
    """Random augmentation from all three RNGs a dataset's code may use."""

    def __len__(self):
        return 50

    def __getitem__(self, index):
        import random

        import numpy as np

        noise = torch.rand(()).item() + random.random() + float(np.random.rand())
        return torch.tensor([float(index), noise], dtype=torch.float64)


def masking_collate(samples):  # randomness in the collate too (MLM-style masking)
    batch = torch.stack(samples)
    return batch, torch.rand(len(samples), dtype=torch.float64)


def make_workers(persistent: bool, then=None):
    loader = DataLoader(
        Augmented(),
        batch_size=4,
        sampler=ResumableSampler(50, seed=5),
        num_workers=2,
        persistent_workers=persistent,
        collate_fn=masking_collate,
        worker_init_fn=then,
    )
    return ResumableLoader(loader)


def drain_pairs(loader, batches):
    out = []
    while len(out) < batches:
        for batch, mask in loader:
            out.append((batch.tolist(), mask.tolist()))
            if len(out) == batches:
                break
    return out


def seed_numpy_per_worker(worker_id):  # the usual recipe; it must still run
    import numpy as np

    np.random.seed(1000 + worker_id)


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_augmentation_is_the_same_after_a_mid_epoch_resume(persistent):
    """With workers, a sample's random augmentation and the collate's draws must not depend
    on which worker loads it or what that worker loaded before: the resumed epoch skips the
    consumed samples and deals the rest to the workers afresh. Before, every value after a
    mid-epoch resume differed."""
    straight = drain_pairs(make_workers(persistent, seed_numpy_per_worker), 20)
    assert len({tuple(b[0][0]) for b in straight}) == 20  # noise: no two batches alike
    # Another epoch, the same sample: other noise (the epoch is part of each sample's seed).
    first_epoch = {row[0]: row[1] for batch, _ in straight[:13] for row in batch}
    second_epoch = {row[0]: row[1] for batch, _ in straight[13:] for row in batch}
    assert all(first_epoch[i] != second_epoch[i] for i in second_epoch)
    for cut in (5, 14):  # mid-epoch 1, mid-epoch 2
        first = make_workers(persistent, seed_numpy_per_worker)
        head = drain_pairs(first, cut)
        second = make_workers(persistent, seed_numpy_per_worker)
        second.load_state_dict(first.state_dict())
        assert head + drain_pairs(second, 20 - cut) == straight, f"cut at batch {cut}"
