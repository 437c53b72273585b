"""Built-in training workloads: small, deterministic, no downloads.

A workload builds the model, optimizer, scheduler and a resumable data loader from a seed,
and knows how to run one training step. Everything is seeded, so two runs with the same
seed produce bit-identical parameters on the same machine and thread count.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pcframe.data import ResumableLoader, ResumableSampler


@dataclass
class Workload:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: ResumableLoader

    def train_step(self, batch: Any) -> float:
        inputs, targets = batch
        loss = nn.functional.cross_entropy(self.model(inputs), targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return loss.detach().item()

    def state_bytes(self) -> int:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return params * 3  # weights + Adam's two moments


def mlp(
    seed: int = 0,
    hidden: int = 256,
    layers: int = 3,
    inputs: int = 64,
    classes: int = 10,
    samples: int = 4096,
    batch_size: int = 64,
    lr: float = 1e-3,
    dropout: float = 0.1,
) -> Workload:
    """A multi-layer perceptron learning a fixed random teacher (with dropout, so RNG matters)."""
    torch.manual_seed(seed)
    data_gen = torch.Generator().manual_seed(seed + 1)
    features = torch.randn(samples, inputs, generator=data_gen)
    teacher = torch.randn(inputs, classes, generator=data_gen)
    labels = (features @ teacher).argmax(dim=1)
    dims = [inputs] + [hidden] * layers
    blocks: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(dims):
        blocks += [
            nn.Linear(fan_in, fan_out),
            nn.LayerNorm(fan_out),
            nn.GELU(),
            nn.Dropout(dropout),
        ]
    model = nn.Sequential(*blocks, nn.Linear(dims[-1], classes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=200)
    sampler = ResumableSampler(samples, seed=seed)
    # The loader gets its own generator: otherwise every new epoch iterator draws a seed from
    # the global RNG, and a resumed run would shift the dropout stream by one draw.
    loader = DataLoader(
        TensorDataset(features, labels),
        batch_size=batch_size,
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed + 2),
    )
    return Workload(model, optimizer, scheduler, ResumableLoader(loader))


WORKLOADS = {"mlp": mlp}


def build(name: str, **kwargs: Any) -> Workload:
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; available: {', '.join(sorted(WORKLOADS))}"
        ) from None
    return factory(**kwargs)
