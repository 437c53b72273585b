"""Data position that survives a restart: a seeded sampler and a loader that counts batches.

A ``DataLoader`` prefetches, so its sampler runs ahead of what the training loop consumed.
:class:`ResumableLoader` therefore counts the batches handed to the loop and, on restore,
tells :class:`ResumableSampler` to skip exactly those samples of the interrupted epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler


class ResumableSampler(Sampler[int]):
    """A permutation per epoch from ``seed + epoch``; can start mid-epoch."""

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ValueError(f"ResumableSampler: num_samples={num_samples} must be >= 1")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.epoch = 0
        self.start = 0  # samples of this epoch to skip (set on restore)

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[int]:
        indices = self.order(self.epoch)[self.start :]
        self.start = 0
        return iter(indices.tolist())

    def __len__(self) -> int:
        return self.num_samples - self.start


class ResumableLoader:
    """Wraps a ``DataLoader`` built on a :class:`ResumableSampler`; iterate it once per epoch.

    ``state_dict()`` is the position after the last batch handed out, so a checkpoint taken
    after a training step resumes with the next unseen batch.
    """

    def __init__(self, loader: DataLoader) -> None:
        if not isinstance(loader.sampler, ResumableSampler):
            raise TypeError(
                "ResumableLoader needs DataLoader(..., sampler=ResumableSampler(len(dataset)))"
            )
        self.loader = loader
        self.sampler: ResumableSampler = loader.sampler
        self.epoch = 0
        self.consumed = 0  # samples of the current epoch handed to the training loop

    def __iter__(self) -> Iterator[Any]:
        self.sampler.epoch, self.sampler.start = self.epoch, self.consumed
        for batch in self.loader:
            self.consumed += _batch_size(batch)
            yield batch
        self.epoch += 1
        self.consumed = 0

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.sampler.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.sampler.seed) != self.sampler.seed:
            raise ValueError(
                f"data position was saved with sampler seed {state['seed']}, but this sampler "
                f"uses {self.sampler.seed}: use the same seed to resume the same data order"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, list | tuple) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")
